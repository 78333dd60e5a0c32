"""Decode's KVTransfer service with the pool backends' PoolHandoff (kvtransfer/backends/pool.py)
beside PushKV and PairSession.

Status codes: FAILED_PRECONDITION = this decode cannot map that pool (prefill sends this
request another way; the transfer is untouched); ABORTED = the transfer failed or is unknown
(its blocks are freed); INVALID_ARGUMENT = a malformed call.
"""
from __future__ import annotations

import grpc

from kvtransfer.backends.pair_service import KVTransferService
from kvtransfer.backends.pool import PoolImporter
from kvtransfer.backends.pool_share import PoolUnreachable
from kvtransfer.state import TransferError
from protos import kvtransfer_pb2


class PoolKVTransferService(KVTransferService):
    def __init__(self, *args, pool_importer: PoolImporter | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool_importer = pool_importer

    async def PoolHandoff(self, request: kvtransfer_pb2.PoolHandoffRequest, context):
        imp = self.pool_importer
        if imp is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this decode takes no pool handoffs (its --kv-transfer-backend)")
        if not request.transfer_id or not request.pool_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id and pool_address are required")
        try:
            nbytes, copy_ms = await imp.handoff(
                request.transfer_id, request.pool_address, request.pool_id,
                list(request.src_block_ids), int(request.num_tokens),
                list(request.k_scales), list(request.v_scales))
        except PoolUnreachable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TransferError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        return kvtransfer_pb2.PoolHandoffReply(bytes_moved=nbytes, copy_ms=copy_ms)

    async def close(self) -> None:
        await super().close()
        if self.pool_importer is not None:
            self.pool_importer.close()
