"""Prefill side of the pool backends (kvtransfer/backends/pool.py): serve the engine's
shareable KV pool to decode peers and hand each request's blocks over with one
KVTransfer.PoolHandoff call to the decode that reserved them.

A decode that cannot map the pool (another host or namespace) answers FAILED_PRECONDITION
before touching the transfer: the sender remembers that decode as unusable for the pool
(`unusable`) and raises PoolUnreachable, so the caller sends this request on another backend.
"""
from __future__ import annotations

import grpc

from common.grpc_util import open_channel
from kvtransfer.backends.pool_share import PoolServer, PoolUnreachable
from kvtransfer.state import TransferError


class PoolKVSender:
    def __init__(self, server: PoolServer, backend: str, channel_options=None, auth=None):
        self.server = server
        self.auth = auth                  # common.auth.InternalAuth (None: insecure plane)
        self.backend = backend            # "vmm" | "shm"
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, object] = {}
        self._down: dict[str, str] = {}   # decode address -> why its pool attach failed
        self._proven: set[str] = set()    # decode addresses whose last handoff succeeded
        self._options = channel_options or []

    def unusable(self, address: str) -> str | None:
        return self._down.get(address)

    def proven(self, address: str) -> bool:
        """The last handoff to this decode succeeded (it maps our pool): callers may answer
        before the next one ends."""
        return address in self._proven

    def prepare(self, address: str, peer) -> None:  # the pool is mapped at the first handoff
        pass

    def _stub(self, address: str):
        stub = self._stubs.get(address)
        if stub is None:
            from protos import kvtransfer_pb2_grpc

            ch = self._channels[address] = open_channel(address, self.auth, self._options)
            stub = self._stubs[address] = kvtransfer_pb2_grpc.KVTransferStub(ch)
        return stub

    async def handoff(self, address: str, transfer_id: str, block_ids: list[int], num_tokens: int,
                      k_scales=None, v_scales=None, timeout_s: float | None = None,
                      metadata: tuple = ()) -> int:
        """-> bytes decode copied. Raises PoolUnreachable (nothing done) or TransferError."""
        from protos import kvtransfer_pb2

        req = kvtransfer_pb2.PoolHandoffRequest(
            transfer_id=transfer_id, pool_address=self.server.address, pool_id=self.server.pool_id,
            src_block_ids=block_ids, num_tokens=num_tokens,
            k_scales=k_scales or [], v_scales=v_scales or [])
        try:
            reply = await self._stub(address).PoolHandoff(req, timeout=timeout_s, metadata=metadata or None)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.ABORTED:  # ABORTED: that transfer is gone, the pair works
                self._proven.discard(address)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._down[address] = e.details() or "decode cannot map the pool"
                raise PoolUnreachable(self._down[address]) from e
            raise TransferError(f"{self.backend} handoff to {address} failed: "
                                f"{e.code().name}: {e.details()}") from e
        except BaseException:  # cancelled or timed out: not known to work
            self._proven.discard(address)
            raise
        self._proven.add(address)
        return int(reply.bytes_moved)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
        self.server.close()
