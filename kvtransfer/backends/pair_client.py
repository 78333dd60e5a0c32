"""Sender side of the direct backends (dist, nixl): a PairClient is one PairSession control
stream to one decode, transfers (PairSendTransfer) multiplexed on it, the layer bytes moved by
a backend-specific data path (subclass hooks). kvtransfer.backends.pair_sender.PairKVSender
keeps one per decode address.

Pair lifecycle (prefill side): connecting -> up -> broken | closed. Connecting sends the hello,
waits for decode's accept, runs the backend's join (dist: the process group), waits for ready.
A pair that fails to connect raises PairUnavailable (nothing was sent: the caller may fall back
to grpc). A pair that breaks later fails every transfer open on it at once and is dropped; the
next transfer builds a new one (new pair id).

Hazards:
- NOTE: a layer's header goes on the stream and its bytes to the data path in one synchronous
  step on the event loop, so the two orders agree (the receiver matches them one to one).
- NOTE: after a transfer fails (nack, abort, deadline) the layers already announced still
  move: the receiver drains them. Only a broken pair stops the data path.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid

import grpc
import torch

from engine.kv_blocks import DTYPE_NAMES
from kvtransfer.base import SendTransfer
from kvtransfer.endpoint import PairEndpoint
from kvtransfer.state import KVLayout, Transfer, TransferError, TransferState
from protos import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger("splitserve.kvtransfer.pair")


class PairUnavailable(TransferError):
    """The pair could not be set up; nothing of the transfer was sent."""


class PairSendTransfer(SendTransfer):
    def __init__(self, pair: "PairClient", record: Transfer, layout: KVLayout, num_tokens: int):
        self.pair = pair
        self.record = record
        self.layout = layout
        self.num_tokens = num_tokens
        self._sends: list[asyncio.Future] = []
        self._sent_layers: set[int] = set()
        self._closed = False
        self._ack: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ack.add_done_callback(_retrieve)

    def send_layer(self, layer_idx, tensor, k_scale=None, v_scale=None) -> None:
        r = self.record
        if self._closed or r.state is TransferState.FAILED:
            raise TransferError(f"transfer {r.transfer_id} is closed" + (f": {r.error}" if r.error else ""))
        if not (0 <= layer_idx < self.layout.num_layers):
            raise TransferError(f"layer {layer_idx} out of range [0, {self.layout.num_layers})")
        if layer_idx in self._sent_layers:
            raise TransferError(f"layer {layer_idx} sent twice")
        dt = DTYPE_NAMES.get(tensor.dtype)
        if dt != self.layout.dtype:
            raise TransferError(f"layer dtype {dt} does not match the ticket's {self.layout.dtype}")
        if tensor.dim() != 5 or tuple(tensor.shape[2:]) != self.layout.layer_shape(0)[2:] or tensor.shape[0] != 2:
            raise TransferError(f"layer shape {tuple(tensor.shape)} does not fit the ticket's layout")
        self._sent_layers.add(layer_idx)
        fut = self.pair.send_layer(self, layer_idx, tensor, k_scale, v_scale)
        fut.add_done_callback(self._on_sent)
        self._sends.append(fut)

    def _on_sent(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        r = self.record
        if r.started_at is None:
            r.started_at = time.monotonic()
        if r.state is TransferState.BOOTSTRAPPING:
            r.state = TransferState.TRANSFERRING
        r.bytes_moved += int(fut.result())

    async def finish(self) -> int:
        r = self.record
        if self._closed:
            raise TransferError(f"transfer {r.transfer_id} is closed")
        self._closed = True
        if r.state is TransferState.FAILED:
            raise TransferError(f"transfer {r.transfer_id} failed: {r.error}")
        self.pair.commit(self)
        left = r.deadline - time.monotonic() if r.deadline != float("inf") else None
        try:
            await asyncio.wait_for(self._wait_all(), left)
        except (asyncio.TimeoutError, TimeoutError):
            self._fail(f"timed out after {r.duration_s:.1f}s (sent {len(self._sent_layers)} layers, "
                       f"{sum(f.done() for f in self._sends)} on the wire)")
            self.pair.abort_transfer(self, "sender timed out")
            raise TransferError(f"transfer {r.transfer_id} failed: {r.error}") from None
        except asyncio.CancelledError:
            self._fail("cancelled")
            self.pair.abort_transfer(self, "sender cancelled")
            raise
        except TransferError as e:
            self._fail(str(e))
            raise TransferError(f"transfer {r.transfer_id} failed: {r.error}") from None
        r.state = TransferState.DONE
        r.finished_at = time.monotonic()
        self.pair.forget(self)
        return r.bytes_moved

    async def _wait_all(self) -> None:
        for f in self._sends:
            await asyncio.shield(f)  # shield: a deadline must not cancel the data path's futures
        await asyncio.shield(self._ack)

    async def abort(self, reason: str) -> None:
        self._closed = True
        if not self.record.state.terminal:
            self._fail(f"aborted: {reason}")
            self.pair.abort_transfer(self, reason)

    # ---- events from the pair ---------------------------------------------------------
    def on_ack(self, ack) -> None:
        if self._ack.done():
            return
        if ack.ok:
            self._ack.set_result(ack)
        else:
            self._fail(f"receiver refused: {ack.message}")
            self._ack.set_exception(TransferError(f"receiver refused: {ack.message}"))

    def on_broken(self, reason: str) -> None:
        self._fail(f"pair broken: {reason}")
        if not self._ack.done():
            self._ack.set_exception(TransferError(f"pair broken: {reason}"))

    def _fail(self, reason: str) -> None:
        r = self.record
        if not r.state.terminal:
            r.state = TransferState.FAILED
            r.error = reason
            r.finished_at = time.monotonic()


class PairClient(abc.ABC):
    """One PairSession stream to one decode, and the backend's data path."""

    backend = "pair"

    def __init__(self, channel: grpc.aio.Channel, address: str, peer: PairEndpoint,
                 local: PairEndpoint, op_timeout_s: float, connect_timeout_s: float):
        self.address = address
        self.peer = peer
        self.local = local
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.pair_id = uuid.uuid4().hex
        self.broken: str | None = None
        self.on_gone = None  # set by the sender: drop this pair from its cache
        self._stub = kvtransfer_pb2_grpc.KVTransferStub(channel)
        self._out: asyncio.Queue = asyncio.Queue()
        self._txs: dict[str, PairSendTransfer] = {}
        self._call = None
        self._reader: asyncio.Task | None = None
        self._seq = 0

    # ---- backend hooks ------------------------------------------------------------------
    @abc.abstractmethod
    def hello(self) -> kvtransfer_pb2.PairHello: ...

    @abc.abstractmethod
    async def join(self, accept: kvtransfer_pb2.PairAccept) -> None:
        """After decode accepted: bring up the data path (may block until decode joins)."""

    def start_send(self, header: kvtransfer_pb2.LayerHeader, tensor: torch.Tensor) -> asyncio.Future:
        """Move one layer's bytes (the header is queued right after this returns)."""
        raise NotImplementedError  # backends override this or send_layer

    def release_transfer(self, tx: PairSendTransfer) -> None:  # noqa: B027 - optional
        """The transfer is over (acked, failed, aborted): free backend resources it held."""

    def close_data_path(self, reason: str, orderly: bool) -> None:  # noqa: B027 - optional
        pass

    async def wait_closed(self) -> None:  # noqa: B027 - optional
        """After close_data_path: until its resources are gone."""

    # ---- connect ------------------------------------------------------------------------
    async def connect(self) -> None:
        """Raises PairUnavailable with the reason (the caller may fall back to grpc)."""
        self._call = self._stub.PairSession(self._requests())
        self._out.put_nowait(kvtransfer_pb2.PairMsg(hello=self.hello()))
        try:
            accept = await self._expect("accept")
            await self.join(accept.accept)
            await self._expect("ready")
        except BaseException as e:
            self._call.cancel()
            self.close_data_path(f"connect failed: {e}", orderly=False)
            if isinstance(e, (TransferError, grpc.aio.AioRpcError, asyncio.TimeoutError, TimeoutError)):
                raise PairUnavailable(f"{self.backend} pair with {self.address} failed: "
                                      f"{_why(e)}") from None
            raise
        self._reader = asyncio.get_running_loop().create_task(self._read_events())
        log.info("kv %s pair %s with %s is up", self.backend, self.pair_id[:8], self.address)

    async def _expect(self, kind: str):
        ev = await asyncio.wait_for(self._call.read(), self.connect_timeout_s)
        if ev is grpc.aio.EOF:
            raise TransferError("decode closed the pair session")
        got = ev.WhichOneof("kind")
        if got == "broken":
            raise TransferError(ev.broken.reason)
        if got != kind:
            raise TransferError(f"expected {kind}, decode sent {got}")
        return ev

    async def _requests(self):
        while True:
            m = await self._out.get()
            if m is None:
                return
            yield m

    async def _read_events(self) -> None:
        reason = "decode closed the pair session"
        try:
            while True:
                ev = await self._call.read()
                if ev is grpc.aio.EOF:
                    break
                kind = ev.WhichOneof("kind")
                if kind == "ack":
                    tx = self._txs.get(ev.ack.transfer_id)
                    if tx is not None:
                        tx.on_ack(ev.ack)
                        self.forget(tx)
                elif kind == "broken":
                    reason = f"decode broke the pair: {ev.broken.reason}"
                    break
        except asyncio.CancelledError:
            return
        except grpc.aio.AioRpcError as e:
            reason = f"pair session lost: {e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001
            reason = f"pair session reader failed: {e!r}"
        self.fail(reason)

    # ---- transfers ----------------------------------------------------------------------
    def open(self, record: Transfer, layout: KVLayout, num_tokens: int) -> PairSendTransfer:
        if self.broken is not None:
            raise TransferError(f"{self.backend} pair with {self.address} is broken: {self.broken}")
        tx = PairSendTransfer(self, record, layout, num_tokens)
        self._txs[record.transfer_id] = tx
        self.send_msg(kvtransfer_pb2.PairMsg(open=kvtransfer_pb2.TransferOpen(
            transfer_id=record.transfer_id, request_id=record.request_id, num_tokens=num_tokens)))
        return tx

    def send_layer(self, tx: PairSendTransfer, layer_idx: int, tensor: torch.Tensor,
                   k_scale, v_scale) -> asyncio.Future:
        """Announce one layer on the stream and start moving its bytes; -> future of the bytes."""
        if self.broken is not None:
            raise TransferError(f"{self.backend} pair with {self.address} is broken: {self.broken}")
        h = self.header(tx, layer_idx, tensor, k_scale, v_scale)
        fut = self.start_send(h, tensor)  # NOTE: same synchronous step as the header (ordering)
        self._seq += 1
        self.send_msg(kvtransfer_pb2.PairMsg(layer=h))
        return fut

    def header(self, tx: PairSendTransfer, layer_idx: int, tensor: torch.Tensor,
               k_scale, v_scale) -> kvtransfer_pb2.LayerHeader:
        h = kvtransfer_pb2.LayerHeader(
            transfer_id=tx.record.transfer_id, layer_index=layer_idx, shape=[int(d) for d in tensor.shape],
            dtype=DTYPE_NAMES[tensor.dtype], nbytes=tensor.numel() * tensor.element_size(), seq=self._seq)
        if k_scale is not None:
            h.k_scale = float(k_scale)
        if v_scale is not None:
            h.v_scale = float(v_scale)
        return h

    def send_msg(self, msg: kvtransfer_pb2.PairMsg) -> None:
        if self.broken is None:
            self._out.put_nowait(msg)

    def commit(self, tx: PairSendTransfer) -> None:
        self.send_msg(kvtransfer_pb2.PairMsg(
            commit=kvtransfer_pb2.TransferCommit(transfer_id=tx.record.transfer_id)))

    def abort_transfer(self, tx: PairSendTransfer, reason: str) -> None:
        if tx.record.transfer_id in self._txs:
            self.send_msg(kvtransfer_pb2.PairMsg(abort=kvtransfer_pb2.TransferAbort(
                transfer_id=tx.record.transfer_id, reason=reason)))
        self.forget(tx)

    def forget(self, tx: PairSendTransfer) -> None:
        if self._txs.pop(tx.record.transfer_id, None) is not None:
            self.release_transfer(tx)

    # ---- teardown -----------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """The pair is unusable: fail its transfers, tear the data path down, drop it."""
        if self.broken is not None:
            return
        self.broken = reason
        log.warning("kv %s pair %s with %s broken: %s", self.backend, self.pair_id[:8], self.address, reason)
        for tx in list(self._txs.values()):
            tx.on_broken(reason)
            self.forget(tx)
        self._out.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        self.close_data_path(reason, orderly=False)
        if self.on_gone is not None:
            self.on_gone(self)

    async def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
            for tx in list(self._txs.values()):
                tx.on_broken("sender closing")
                self.forget(tx)
            self._out.put_nowait(None)  # ends the stream: decode closes its side
            self.close_data_path("closed", orderly=True)
        if self._reader is not None:
            self._reader.cancel()
        await self.wait_closed()


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "no answer in time"
    return str(e)


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a future's exception as seen (it is reported through the transfer instead)."""
    if not fut.cancelled():
        fut.exception()
