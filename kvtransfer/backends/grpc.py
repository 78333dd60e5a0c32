"""gRPC backend: KV moves as a client stream of byte chunks (protos kvtransfer.proto).

Sender (prefill) -> KVTransfer.PushKV on the decode service's gRPC server -> KVReceiver.
Per layer, chunks of <= chunk_bytes with increasing byte_offset; the layer's first chunk
carries shape / dtype / scales. Final message: commit=True. Ack: ok or the failure reason.

Hazards:
- a layer tensor passed to send_layer must not be mutated until finish() returns (the bytes
  are sliced lazily as gRPC flow control pulls chunks);
- the servicer treats a stream that ends or breaks without commit as a dead sender and fails
  the transfer (blocks released), even when the handler itself is being cancelled;
- a sender that stalls (opens the stream, then sends nothing) is cut at the transfer's
  deadline: the stream ends with a failed ack instead of holding its buffers indefinitely.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from common.grpc_util import channel_options, open_channel
from common.telemetry import server_span, set_attrs
from engine.kv_blocks import DTYPE_NAMES, NAME_DTYPES
from kvtransfer.base import KVSender, SendTransfer
from kvtransfer.receiver import KVReceiver
from kvtransfer.state import KVLayout, SendRecords, Transfer, TransferError, TransferState
from protos import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger("splitserve.kvtransfer.grpc")

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
_COMMIT = object()


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServicer):
    """Receives PushKV streams and feeds a KVReceiver."""

    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver

    async def PushKV(self, request_iterator, context):
        with server_span("kv.receive", context, attributes={"splitserve.kv.backend": "grpc"}) as sp:
            ack = await self._push(request_iterator)
            set_attrs(sp, {"splitserve.kv.bytes": ack.bytes_received, "splitserve.ok": ack.ok,
                           "splitserve.kv.layers": ack.layers_received})
            return ack

    async def _push(self, request_iterator):
        rx = self.receiver
        tid = None
        committed = False
        bufs: dict[int, tuple[bytearray, int, tuple, str, float | None, float | None]] = {}
        nbytes = 0
        chunks = request_iterator.__aiter__()
        try:
            while True:
                try:
                    ch = await asyncio.wait_for(chunks.__anext__(), self._chunk_wait_s(tid))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise TransferError(self._stalled(tid)) from None
                if not ch.transfer_id:
                    raise TransferError("chunk without transfer_id")
                if tid is None:
                    tid = ch.transfer_id
                    rx.check_open(tid)
                elif ch.transfer_id != tid:
                    raise TransferError("one stream carries one transfer")
                if ch.commit:
                    if bufs:
                        raise TransferError(f"commit with layers {sorted(bufs)} incomplete")
                    await rx.on_commit(tid)
                    committed = True
                    break
                li = ch.layer_index
                if li not in bufs:  # layer's first chunk: header fields
                    if ch.byte_offset != 0:
                        raise TransferError(f"layer {li} starts at offset {ch.byte_offset}")
                    shape = tuple(ch.shape)
                    rx.check_layer(tid, li, shape, ch.dtype)
                    want = rx.layout.layer_nbytes(shape[1])
                    if ch.layer_nbytes != want:
                        raise TransferError(f"layer {li}: {ch.layer_nbytes} bytes announced, "
                                            f"shape {shape} needs {want}")
                    bufs[li] = (bytearray(want), 0, shape, ch.dtype,
                                ch.k_scale if ch.HasField("k_scale") else None,
                                ch.v_scale if ch.HasField("v_scale") else None)
                buf, got, shape, dtype, ks, vs = bufs[li]
                if ch.byte_offset != got:
                    raise TransferError(f"layer {li}: chunk at {ch.byte_offset}, expected {got}")
                end = got + len(ch.data)
                if end > len(buf):
                    raise TransferError(f"layer {li}: {end} bytes > {len(buf)}")
                buf[got:end] = ch.data
                rx.on_data(tid, len(ch.data))
                nbytes += len(ch.data)
                bufs[li] = (buf, end, shape, dtype, ks, vs)
                if end == len(buf):
                    del bufs[li]
                    # the tensor takes over buf (no copy); buf is not touched again
                    t = torch.frombuffer(buf, dtype=torch.uint8).view(NAME_DTYPES[dtype]).reshape(shape)
                    await rx.on_layer(tid, li, t, ks, vs)
            if not committed:
                raise TransferError("stream ended before commit (sender died?)")
            t = rx.get(tid)
            return kvtransfer_pb2.PushKVAck(transfer_id=tid, ok=True, bytes_received=nbytes,
                                            layers_received=len(t.layers_done) if t else 0)
        except (TransferError, ValueError, KeyError, RuntimeError) as e:  # bad data / sink refused
            if not isinstance(e, TransferError):
                log.exception("kv transfer %s: writing failed", tid)
            msg = str(e) if isinstance(e, TransferError) else f"{type(e).__name__}: {e}"
            if tid is not None:
                rx.fail(tid, msg)
            return kvtransfer_pb2.PushKVAck(transfer_id=tid or "", ok=False, message=msg,
                                            bytes_received=nbytes)
        except BaseException as e:  # cancelled (peer gone), broken stream
            if tid is not None and not committed:
                rx.fail(tid, f"stream broken: {type(e).__name__}: {e}")
            raise


    def _chunk_wait_s(self, tid: str | None) -> float:
        """How long the next chunk may take: until the transfer's deadline (+ one reaper pass,
        so the reaper's timeout names the cause); before the first chunk, the default hold."""
        rx = self.receiver
        t = rx.get(tid) if tid is not None else None
        if t is None:
            return rx.default_timeout_s
        return max(t.deadline - time.monotonic(), 0.0) + 2 * rx.reap_interval_s

    def _stalled(self, tid: str | None) -> str:
        t = self.receiver.get(tid) if tid is not None else None
        if t is not None and t.error:
            return t.error
        return "sender stalled: no KV chunk before the transfer's deadline"


class GrpcSendTransfer(SendTransfer):
    def __init__(self, stub, record: Transfer, layout: KVLayout, num_tokens: int,
                 chunk_bytes: int, timeout_s: float | None, metadata=None):
        self.record = record
        self.layout = layout
        self.num_tokens = num_tokens
        self.chunk_bytes = chunk_bytes
        self._q: asyncio.Queue = asyncio.Queue()
        self._sent_layers: set[int] = set()
        self._closed = False
        self._call = stub.PushKV(self._chunks(), timeout=timeout_s, metadata=metadata)

    async def _chunks(self):
        tid = self.record.transfer_id
        while True:
            item = await self._q.get()
            if item is _COMMIT:
                yield kvtransfer_pb2.KVChunk(transfer_id=tid, commit=True,
                                             num_layers=self.layout.num_layers)
                return
            li, t, ks, vs = item
            raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
            mv = memoryview(raw)
            total = len(mv)
            for off in range(0, total, self.chunk_bytes):
                ch = kvtransfer_pb2.KVChunk(transfer_id=tid, layer_index=li, byte_offset=off,
                                            data=bytes(mv[off:off + self.chunk_bytes]))
                if off == 0:
                    ch.layer_nbytes = total
                    ch.dtype = DTYPE_NAMES[t.dtype]
                    ch.shape.extend(int(d) for d in t.shape)
                    ch.num_layers = self.layout.num_layers
                    ch.num_tokens = self.num_tokens
                    ch.block_size = self.layout.block_size
                    if ks is not None:
                        ch.k_scale = float(ks)
                    if vs is not None:
                        ch.v_scale = float(vs)
                if self.record.started_at is None:
                    self.record.started_at = time.monotonic()
                self.record.state = TransferState.TRANSFERRING
                self.record.bytes_moved += len(ch.data)
                yield ch

    def send_layer(self, layer_idx, tensor, k_scale=None, v_scale=None) -> None:
        if self._closed:
            raise TransferError(f"transfer {self.record.transfer_id} is closed")
        if layer_idx in self._sent_layers:
            raise TransferError(f"layer {layer_idx} sent twice")
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        self._sent_layers.add(layer_idx)
        self._q.put_nowait((layer_idx, tensor, k_scale, v_scale))

    async def finish(self) -> int:
        if self._closed:
            raise TransferError(f"transfer {self.record.transfer_id} is closed")
        self._closed = True
        self._q.put_nowait(_COMMIT)
        r = self.record
        try:
            ack = await self._call
        except grpc.aio.AioRpcError as e:
            self._fail(f"{e.code().name}: {e.details()}")
            raise TransferError(f"transfer {r.transfer_id} failed: {r.error}") from None
        except asyncio.CancelledError:
            self._call.cancel()
            self._fail("cancelled")
            raise
        if not ack.ok:
            self._fail(f"receiver refused: {ack.message}")
            raise TransferError(f"transfer {r.transfer_id} failed: {r.error}")
        r.state = TransferState.DONE
        r.finished_at = time.monotonic()
        return r.bytes_moved

    async def abort(self, reason: str) -> None:
        self._closed = True
        if not self.record.state.terminal:
            self._call.cancel()
            self._fail(f"aborted: {reason}")

    def _fail(self, reason: str) -> None:
        if self.record.state is not TransferState.FAILED:
            self.record.state = TransferState.FAILED
            self.record.error = reason
            self.record.finished_at = time.monotonic()


class GrpcKVSender(KVSender):
    """Keeps one channel per decode address; transfers are independent streams on it."""

    backend = "grpc"

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_records: int = 1024, auth=None):
        self.auth = auth  # common.auth.InternalAuth of the internal plane (None: insecure)
        if not (1024 <= chunk_bytes <= 32 * 1024 * 1024):
            raise ValueError(f"chunk_bytes must be in [1 KiB, 32 MiB], got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._records = SendRecords(keep_records)

    def _stub(self, address: str):
        ch = self._channels.get(address)
        if ch is None:
            ch = open_channel(address, self.auth, channel_options())
            self._channels[address] = ch
        return kvtransfer_pb2_grpc.KVTransferStub(ch)

    async def open(self, address, transfer_id, request_id, layout, num_tokens, timeout_s=None,
                   metadata=None, *, peer=None) -> GrpcSendTransfer:
        if not address:
            raise TransferError("no decode address in the transfer ticket")
        rec = self._records.open(transfer_id, request_id, timeout_s)
        return GrpcSendTransfer(self._stub(address), rec, layout, num_tokens, self.chunk_bytes,
                                timeout_s, metadata)

    def get(self, transfer_id: str) -> Transfer | None:
        return self._records.get(transfer_id)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
