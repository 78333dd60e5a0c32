"""Receiver side of the direct backends: KVTransfer.PairSession on the decode service.

One session per prefill/decode pair (see kvtransfer.proto for the message flow). The session
checks each message against the KVReceiver (the same bookkeeping PushKV feeds), asks its
RecvPlane to move the bytes, writes complete layers through the receiver's sink, and answers
one ack per transfer. `KVTransferService` serves both PushKV (grpc backend) and PairSession.

Invariants:
- one `plane.post` per layer header, in stream order, whatever happens to the transfer; a
  refused layer is drained (dist) or never read (nixl). Only a broken data path or a bad
  header (seq gap, inconsistent size) breaks the pair.
- the engine's blocks are written only through the sink (engine thread) or, for a plane that
  lands bytes in place (nixl), only after the layer header was checked against the open
  transfer's reservation.
- a session that ends for any reason fails every transfer it has not acked (blocks released
  by the receiver, exactly once).
"""
from __future__ import annotations

import abc
import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.kv_blocks import NAME_DTYPES
from kvtransfer.backends.grpc import KVTransferServicer
from kvtransfer.receiver import KVReceiver
from kvtransfer.state import TransferError
from protos import kvtransfer_pb2

log = logging.getLogger("splitserve.kvtransfer.pair")


class RecvPlane(abc.ABC):
    """The data side of one pair session on the receiver."""

    backend = "plane"

    @abc.abstractmethod
    async def accept(self, hello) -> kvtransfer_pb2.PairAccept:
        """Check the hello; raise TransferError to refuse the pair."""

    @abc.abstractmethod
    async def join(self, hello) -> None:
        """Bring the data path up (dist: join the group as rank 1)."""

    @abc.abstractmethod
    def post(self, header, request_id: str | None) -> asyncio.Future:
        """Start receiving one layer. Called synchronously, in header order. request_id None:
        the layer was refused; drain or skip it. Result: the layer's bytes as a flat uint8
        tensor, or None when they already landed in the request's reserved blocks. Raises
        (through the future) TransferError when the data path is broken."""

    def recycle(self, data: torch.Tensor) -> None:  # noqa: B027 - optional
        """A tensor `post` returned is no longer used (its bytes were written or dropped)."""

    def close(self, reason: str, orderly: bool) -> None:  # noqa: B027 - optional
        pass

    async def wait_closed(self) -> None:  # noqa: B027 - optional
        """After close(): until the data path's resources are gone."""


class _Broken(Exception):
    """The pair cannot go on (protocol violation or a broken data path)."""


@dataclass
class _Tx:
    transfer_id: str
    request_id: str
    tasks: list = field(default_factory=list)
    failed: bool = False
    nbytes: int = 0


class _Session:
    def __init__(self, svc: "KVTransferService"):
        self.svc = svc
        self.rx: KVReceiver = svc.receiver
        self.events: asyncio.Queue = asyncio.Queue()
        self.plane: RecvPlane | None = None
        self.txs: dict[str, _Tx] = {}
        self.stray: set[asyncio.Task] = set()  # layers of unknown / forgotten transfers
        self.next_seq = 0
        self.closed = False

    def emit(self, ev) -> None:
        if not self.closed:
            self.events.put_nowait(ev)

    async def run(self, it) -> None:
        try:
            first = await it.__anext__()
            if first.WhichOneof("kind") != "hello":
                raise _Broken(f"first message must be hello, got {first.WhichOneof('kind')}")
            hello = first.hello
            factory = self.svc.planes.get(hello.backend)
            if factory is None:
                offered = sorted(self.svc.planes) or ["none: this decode runs the grpc backend only"]
                raise _Broken(f"this decode does not accept {hello.backend!r} pairs (accepts: "
                              f"{', '.join(offered)})")
            self.plane = factory()
            self.emit(kvtransfer_pb2.PairEvent(accept=await self.plane.accept(hello)))
            await self.plane.join(hello)
            self.emit(kvtransfer_pb2.PairEvent(ready=kvtransfer_pb2.PairReady()))
            log.info("kv %s pair %s joined (prefill on %s)", hello.backend, hello.pair_id[:8], hello.device)
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    self.on_open(msg.open)
                elif kind == "layer":
                    self.on_layer(msg.layer)
                elif kind == "commit":
                    self.on_commit(msg.commit)
                elif kind == "abort":
                    self.on_abort(msg.abort)
                else:
                    raise _Broken(f"unexpected {kind} message")
            self.shutdown("prefill closed the pair session", orderly=True)
        except StopAsyncIteration:
            self.shutdown("pair session ended before hello", orderly=True)
        except (_Broken, TransferError) as e:
            self.break_(str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream (prefill died) or a bug
            self.break_(f"{type(e).__name__}: {e}")

    # ---- messages -----------------------------------------------------------------------
    def on_open(self, o) -> None:
        if o.transfer_id in self.txs:
            raise _Broken(f"transfer {o.transfer_id} opened twice")
        tx = self.txs[o.transfer_id] = _Tx(o.transfer_id, o.request_id)
        try:
            rec = self.rx.check_open(o.transfer_id)
        except TransferError as e:
            self.fail_tx(tx, str(e))
            return
        if rec.request_id != o.request_id:
            # NOTE: not ours to fail: the reservation belongs to another request id
            self.fail_tx(tx, f"transfer {o.transfer_id} is reserved for request {rec.request_id!r}, "
                             f"not {o.request_id!r}", fail_receiver=False)

    def on_layer(self, h) -> None:
        if h.seq != self.next_seq:
            raise _Broken(f"layer header seq {h.seq}, expected {self.next_seq}")
        self.next_seq += 1
        self._check_size(h)
        tx = self.txs.get(h.transfer_id)
        rid = None
        if tx is not None and not tx.failed:
            try:
                self.rx.check_layer(h.transfer_id, h.layer_index, tuple(h.shape), h.dtype)
                rid = tx.request_id
            except TransferError as e:
                self.fail_tx(tx, str(e))
        fut = self.plane.post(h, rid)  # NOTE: always, in order (drains a refused layer)
        task = asyncio.get_running_loop().create_task(self._land(tx, h, fut, rid is not None))
        if tx is not None and rid is not None:
            tx.tasks.append(task)
        else:
            self.stray.add(task)
            task.add_done_callback(self.stray.discard)

    def _check_size(self, h) -> None:
        dt = NAME_DTYPES.get(h.dtype)
        if dt is None or len(h.shape) != 5:
            raise _Broken(f"bad layer header: dtype {h.dtype!r}, shape {list(h.shape)}")
        want = math.prod(h.shape) * torch.empty((), dtype=dt).element_size()
        if want != h.nbytes:
            raise _Broken(f"layer header announces {h.nbytes} B, shape {list(h.shape)} needs {want}")
        if h.nbytes > self.svc.max_layer_bytes:
            raise _Broken(f"layer of {h.nbytes} B exceeds what this decode can hold "
                          f"({self.svc.max_layer_bytes} B)")

    async def _land(self, tx: _Tx | None, h, fut: asyncio.Future, accepted: bool) -> None:
        try:
            data = await fut
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - the data path failed: the pair is gone
            self.break_(f"receiving layer {h.layer_index} of {h.transfer_id} failed: {e}")
            return
        await self._write(tx, h, data, accepted)
        if data is not None:
            # NOTE: only once the sink's copy is done; a cancelled write may still be reading
            # the buffer on the engine thread, so that buffer is never reused
            self.plane.recycle(data)

    async def _write(self, tx: _Tx | None, h, data, accepted: bool) -> None:
        if not accepted or tx is None or tx.failed:
            return  # drained
        tid = tx.transfer_id
        ks = h.k_scale if h.HasField("k_scale") else None
        vs = h.v_scale if h.HasField("v_scale") else None
        try:
            self.rx.on_data(tid, int(h.nbytes))
            if data is None:
                self.rx.on_layer_landed(tid, h.layer_index, tuple(h.shape), h.dtype, ks, vs)
            else:
                if data.is_cuda:
                    # NOTE: the buffer came from the pair thread's stream; the engine reads it
                    # on the default stream: keep the memory until that read is done.
                    data.record_stream(torch.cuda.default_stream(data.device))
                t = data.view(NAME_DTYPES[h.dtype]).reshape(tuple(h.shape))
                await self.rx.on_layer(tid, h.layer_index, t, ks, vs)
            tx.nbytes += int(h.nbytes)
        except Exception as e:  # noqa: BLE001 - bad data or the sink refused: this transfer fails
            if not isinstance(e, TransferError):
                log.exception("kv transfer %s: writing layer %d failed", tid, h.layer_index)
            self.fail_tx(tx, str(e) if isinstance(e, TransferError) else f"{type(e).__name__}: {e}")

    def on_commit(self, c) -> None:
        tx = self.txs.get(c.transfer_id)
        if tx is None:
            self.emit(kvtransfer_pb2.PairEvent(ack=kvtransfer_pb2.TransferAck(
                transfer_id=c.transfer_id, ok=False, message="commit of a transfer not open on this pair")))
            return
        task = asyncio.get_running_loop().create_task(self._commit(tx))
        self.stray.add(task)
        task.add_done_callback(self.stray.discard)

    async def _commit(self, tx: _Tx) -> None:
        await asyncio.gather(*tx.tasks, return_exceptions=True)
        if tx.failed:
            return
        try:
            t = await self.rx.on_commit(tx.transfer_id)
        except TransferError as e:
            self.fail_tx(tx, str(e))
            return
        self.txs.pop(tx.transfer_id, None)
        self.emit(kvtransfer_pb2.PairEvent(ack=kvtransfer_pb2.TransferAck(
            transfer_id=tx.transfer_id, ok=True, bytes_received=tx.nbytes,
            layers_received=len(t.layers_done))))

    def on_abort(self, a) -> None:
        tx = self.txs.pop(a.transfer_id, None)
        if tx is not None and not tx.failed:
            tx.failed = True
            self.rx.fail(a.transfer_id, f"aborted by prefill: {a.reason}")

    # ---- failure ------------------------------------------------------------------------
    def fail_tx(self, tx: _Tx, msg: str, fail_receiver: bool = True) -> None:
        """Fail one transfer (blocks released by the receiver) and nack it, once."""
        if tx.failed:
            return
        tx.failed = True
        self.txs.pop(tx.transfer_id, None)  # later layers of it are drained as strays
        if fail_receiver:
            self.rx.fail(tx.transfer_id, msg)
        self.emit(kvtransfer_pb2.PairEvent(ack=kvtransfer_pb2.TransferAck(
            transfer_id=tx.transfer_id, ok=False, message=msg)))

    def break_(self, reason: str) -> None:
        if self.closed:
            return
        log.warning("kv pair session broken: %s", reason)
        self.emit(kvtransfer_pb2.PairEvent(broken=kvtransfer_pb2.PairBroken(reason=reason)))
        self.shutdown(reason)

    def shutdown(self, reason: str, orderly: bool = False) -> None:
        """End the session: fail what is open, tear the data path down, end the stream."""
        if self.closed:
            return
        for tx in list(self.txs.values()):
            if not tx.failed:
                tx.failed = True
                self.rx.fail(tx.transfer_id, f"pair session ended before commit: {reason}")
            for t in tx.tasks:
                t.cancel()
        self.txs.clear()
        for t in list(self.stray):
            t.cancel()
        if self.plane is not None:
            self.plane.close(reason, orderly=orderly)
        self.events.put_nowait(None)
        self.closed = True


class KVTransferService(KVTransferServicer):
    """PushKV (grpc backend) plus PairSession for the direct backends.

    planes: hello backend ("gloo" | "nccl" | "nixl") -> factory of a RecvPlane for a new pair.
    max_layer_bytes: refuse (break) a pair announcing a bigger layer than this decode holds."""

    def __init__(self, receiver: KVReceiver, planes: dict[str, Callable[[], RecvPlane]] | None = None,
                 max_layer_bytes: int | None = None):
        super().__init__(receiver)
        self.planes = dict(planes or {})
        self.max_layer_bytes = max_layer_bytes or (1 << 40)
        self._sessions: set[_Session] = set()
        self._closing: set[asyncio.Task] = set()  # planes being torn down

    async def PairSession(self, request_iterator, context):
        sess = _Session(self)
        self._sessions.add(sess)
        task = asyncio.get_running_loop().create_task(sess.run(request_iterator))
        try:
            while True:
                ev = await sess.events.get()
                if ev is None:
                    return
                yield ev
        finally:
            task.cancel()
            sess.shutdown("pair session cancelled (prefill gone?)")
            self._sessions.discard(sess)
            if sess.plane is not None:
                t = asyncio.get_running_loop().create_task(sess.plane.wait_closed())
                self._closing.add(t)
                t.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Break every session and wait until their data paths are gone."""
        planes = [s.plane for s in self._sessions if s.plane is not None]
        for s in list(self._sessions):
            s.break_("decode shutting down")
        await asyncio.gather(*(p.wait_closed() for p in planes), *self._closing,
                             return_exceptions=True)
