"""KVReceiver: decode-side transfer bookkeeping, independent of the wire backend.

The decode service `expect`s a transfer when it reserves blocks; a backend server (e.g.
kvtransfer.backends.grpc.KVTransferServicer, kvtransfer.backends.pair_service.KVTransferService)
calls `on_layer` for every complete layer (or `on_layer_landed` when the transport wrote the
blocks itself) and `on_commit` at the end; the Decode handler `wait`s for DONE and `claim`s the
blocks.

Invariants:
- a FAILED transfer's blocks are released exactly once, through `sink.release(request_id)`;
- an unclaimed transfer (BOOTSTRAPPING, TRANSFERRING, or DONE but no Decode came) fails at its
  deadline (the reaper), so a reservation whose transfer never comes is freed;
- a claimed transfer is no longer the receiver's business (the engine request owns the blocks).
All methods run on the event loop that created the receiver.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import torch

from kvtransfer.state import KVLayout, Transfer, TransferError, TransferState

log = logging.getLogger("splitserve.kvtransfer.receiver")


class KVSink(Protocol):
    """Where received KV goes (decode service: the engine, via AsyncEngine.call)."""

    async def write_layer(self, request_id: str, layer_idx: int, tensor: torch.Tensor,
                          num_tokens: int) -> None: ...

    async def write_scales(self, request_id: str, k_scales: list[float],
                           v_scales: list[float]) -> None: ...

    async def release(self, request_id: str, transfer_id: str) -> None:
        """Free the blocks reserved for this transfer. NOTE: a request id can be reserved
        again (a retry) after a transfer failed; the sink must not free a newer reservation."""


class KVReceiver:
    def __init__(self, sink: KVSink, layout: KVLayout, *, default_timeout_s: float = 30.0,
                 keep_failed_s: float = 60.0, reap_interval_s: float = 0.25):
        self.sink = sink
        self.layout = layout
        self.default_timeout_s = default_timeout_s
        self.keep_failed_s = keep_failed_s
        self.reap_interval_s = reap_interval_s
        self._transfers: dict[str, Transfer] = {}
        self._meta: dict[str, tuple[int, int]] = {}  # transfer id -> (reserved blocks, num_tokens)
        self._events: dict[str, asyncio.Event] = {}
        self._reaper: asyncio.Task | None = None
        self.num_failed = 0
        self.num_done = 0
        # transfers whose KV has not landed (neither DONE nor FAILED); an int other threads
        # may read (decode's step pacer)
        self.num_awaiting = 0

    # ---- decode-service side ---------------------------------------------------------
    def expect(self, transfer_id: str, request_id: str, num_blocks: int, num_tokens: int,
               timeout_s: float | None = None, block_ids: list[int] | None = None,
               skip_blocks: int = 0) -> Transfer:
        """num_blocks / block_ids: what the transfer writes, the prompt's blocks from
        `skip_blocks` on (the leading ones decode already holds are not sent)."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} already exists")
        t = Transfer(transfer_id, request_id, block_ids=list(block_ids) if block_ids is not None else None,
                     skip_blocks=skip_blocks)
        t.deadline = t.created + (timeout_s if timeout_s else self.default_timeout_s)
        self._transfers[transfer_id] = t
        self._meta[transfer_id] = (num_blocks, num_tokens)
        self._events[transfer_id] = asyncio.Event()
        self.num_awaiting += 1
        self._ensure_reaper()
        return t

    def get(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def find_request(self, request_id: str) -> Transfer | None:
        """The live (unclaimed, not failed) transfer of a request, if any."""
        for t in self._transfers.values():
            if t.request_id == request_id and not t.claimed and t.state is not TransferState.FAILED:
                return t
        return None

    def pending(self) -> list[Transfer]:
        """Unclaimed, not failed transfers (they hold reserved blocks)."""
        return [t for t in self._transfers.values()
                if not t.claimed and t.state is not TransferState.FAILED]

    async def wait(self, transfer_id: str, timeout_s: float | None = None) -> Transfer:
        """-> the DONE transfer; raises KeyError (unknown), TransferError (FAILED), or
        TimeoutError (not done within timeout_s; the transfer is left running)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            raise KeyError(f"unknown transfer {transfer_id!r} (never reserved, or expired)")
        if not t.state.terminal:
            await asyncio.wait_for(self._events[transfer_id].wait(), timeout_s)
        if t.state is TransferState.FAILED:
            raise TransferError(f"transfer {transfer_id} failed: {t.error}")
        return t

    def claim(self, transfer_id: str) -> Transfer:
        """The caller takes over a DONE transfer's blocks: no expiry, no release from here."""
        t = self._transfers.get(transfer_id)
        if t is None:
            raise KeyError(f"unknown transfer {transfer_id!r} (already claimed, or expired)")
        if t.state is not TransferState.DONE:
            raise TransferError(f"transfer {transfer_id} is {t.state.value}, not done")
        t.claimed = True
        self._transfers.pop(transfer_id, None)
        self._meta.pop(transfer_id, None)
        self._events.pop(transfer_id, None)
        return t

    def fail(self, transfer_id: str, reason: str, release: bool = True) -> bool:
        """Mark FAILED and free its blocks (release runs as a task). Safe from a cancelled
        handler: does not await. -> False if already terminal+released or unknown.
        release=False: the caller frees the blocks itself (in order with what it does next)."""
        t = self._transfers.get(transfer_id)
        if t is None or t.claimed or t.state is TransferState.FAILED:
            return False
        if t.state is not TransferState.DONE:
            self.num_awaiting -= 1
        t.state = TransferState.FAILED
        t.error = reason
        t.finished_at = time.monotonic()
        self.num_failed += 1
        log.warning("kv transfer %s (request %s) failed: %s", transfer_id, t.request_id, reason)
        self._events[transfer_id].set()
        if release:
            task = asyncio.get_running_loop().create_task(self.sink.release(t.request_id, transfer_id))
            task.add_done_callback(_log_task_error)
        return True

    # ---- backend side ----------------------------------------------------------------
    def check_open(self, transfer_id: str) -> Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise TransferError(f"unknown transfer {transfer_id!r} (never reserved, or expired)")
        if t.state.terminal:
            raise TransferError(f"transfer {transfer_id} is already {t.state.value}"
                                + (f": {t.error}" if t.error else ""))
        return t

    def check_layer(self, transfer_id: str, layer_idx: int, shape, dtype: str) -> None:
        t = self.check_open(transfer_id)
        if not (0 <= layer_idx < self.layout.num_layers):
            raise TransferError(f"layer {layer_idx} out of range [0, {self.layout.num_layers})")
        if layer_idx in t.layers_done:
            raise TransferError(f"layer {layer_idx} sent twice")
        self.layout.check_layer(tuple(shape), dtype, self._meta[transfer_id][0])
        if t.num_blocks is not None and shape[1] != t.num_blocks:
            raise TransferError(f"layer {layer_idx} has {shape[1]} blocks, earlier layers {t.num_blocks}")

    def on_data(self, transfer_id: str, nbytes: int) -> None:
        t = self.check_open(transfer_id)
        if t.started_at is None:
            t.started_at = time.monotonic()
        t.state = TransferState.TRANSFERRING
        t.bytes_moved += nbytes

    async def on_layer(self, transfer_id: str, layer_idx: int, tensor: torch.Tensor,
                       k_scale: float | None, v_scale: float | None) -> None:
        """A complete layer arrived: validate, write into the reserved blocks."""
        self.check_layer(transfer_id, layer_idx, tensor.shape, _dtype_name(tensor))
        t = self._transfers[transfer_id]
        t.num_blocks = int(tensor.shape[1])
        t.state = TransferState.TRANSFERRING
        await self.sink.write_layer(t.request_id, layer_idx, tensor, self._meta[transfer_id][1])
        self.check_open(transfer_id)  # it may have failed (deadline) while we wrote
        self._layer_done(t, layer_idx, k_scale, v_scale)

    def on_layer_landed(self, transfer_id: str, layer_idx: int, shape, dtype: str,
                        k_scale: float | None, v_scale: float | None) -> None:
        """A layer's bytes were written into the reserved blocks by the transport itself
        (nixl READ into the engine's cache); the caller checked the header before that."""
        self.check_layer(transfer_id, layer_idx, shape, dtype)
        t = self._transfers[transfer_id]
        t.num_blocks = int(shape[1])
        t.state = TransferState.TRANSFERRING
        self._layer_done(t, layer_idx, k_scale, v_scale)

    @staticmethod
    def _layer_done(t: Transfer, layer_idx: int, k_scale, v_scale) -> None:
        t.layers_done.add(layer_idx)
        if k_scale is not None:
            t.k_scales[layer_idx] = k_scale
        if v_scale is not None:
            t.v_scales[layer_idx] = v_scale

    async def on_commit(self, transfer_id: str) -> Transfer:
        t = self.check_open(transfer_id)
        missing = sorted(set(range(self.layout.num_layers)) - t.layers_done)
        if missing:
            raise TransferError(f"commit with layers {missing[:8]} missing")
        want = -(-self._meta[transfer_id][1] // self.layout.block_size) - t.skip_blocks
        if t.skip_blocks and t.num_blocks != want:  # the sender skipped another count of blocks
            raise TransferError(f"{t.num_blocks} blocks sent, {want} expected after the "
                                f"{t.skip_blocks} decode holds")
        if t.k_scales or t.v_scales:
            n = self.layout.num_layers
            if len(t.k_scales) != n or len(t.v_scales) != n:
                raise TransferError("fp8 scales must come with every layer")
            await self.sink.write_scales(t.request_id, [t.k_scales[i] for i in range(n)],
                                         [t.v_scales[i] for i in range(n)])
            self.check_open(transfer_id)
        t.state = TransferState.DONE
        t.finished_at = time.monotonic()
        self.num_done += 1
        self.num_awaiting -= 1
        self._events[transfer_id].set()
        return t

    # ---- expiry ----------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def _reap_loop(self) -> None:
        while self._transfers:
            await asyncio.sleep(self.reap_interval_s)
            self.reap()

    def reap(self) -> None:
        now = time.monotonic()
        for tid, t in list(self._transfers.items()):
            if t.state is TransferState.FAILED:
                if now - (t.finished_at or now) > self.keep_failed_s:
                    self._transfers.pop(tid, None)
                    self._meta.pop(tid, None)
                    self._events.pop(tid, None)
            elif now > t.deadline:
                what = "no Decode claimed it" if t.state is TransferState.DONE else "KV did not arrive"
                self.fail(tid, f"timed out: {what} within {t.deadline - t.created:.1f}s")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for tid in list(self._transfers):
            self.fail(tid, "receiver shutting down")


def _dtype_name(t: torch.Tensor) -> str:
    from engine.kv_blocks import DTYPE_NAMES

    return DTYPE_NAMES[t.dtype]


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("release callback failed: %r", task.exception())
