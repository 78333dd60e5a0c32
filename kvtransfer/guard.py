"""Decode writes into a request's reserved blocks outside the engine thread (a nixl READ, a
pool copy). A reservation freed while such a write runs would hand the write's target to
another request, so the sink's release waits for the request's writes in flight.

    guard = InflightGuard()
    rx = KVReceiver(GuardedSink(sink, guard), layout)
    guard.enter(rid) ... guard.exit(rid)      # around each write (or guard.track(rid, future))
"""
from __future__ import annotations

import asyncio
from collections import defaultdict


class InflightGuard:
    """Counts writes in flight into each request's blocks (on the event loop)."""

    def __init__(self):
        self._n: dict[str, int] = defaultdict(int)
        self._idle: dict[str, asyncio.Event] = {}

    def enter(self, rid: str) -> None:
        self._n[rid] += 1
        self._idle.setdefault(rid, asyncio.Event()).clear()

    def exit(self, rid: str) -> None:
        self._n[rid] -= 1
        if self._n[rid] <= 0:
            self._n.pop(rid, None)
            ev = self._idle.pop(rid, None)
            if ev is not None:
                ev.set()

    def track(self, rid: str, fut: asyncio.Future) -> None:
        """A write that ends when `fut` does (however it ends)."""
        self.enter(rid)
        fut.add_done_callback(lambda _f: self.exit(rid))

    async def idle(self, rid: str) -> None:
        """Until no write into `rid`'s blocks is in flight."""
        ev = self._idle.get(rid)
        if ev is not None:
            await ev.wait()


class GuardedSink:
    """A KVSink whose release waits for the request's writes in flight (see the module)."""

    def __init__(self, inner, guard: InflightGuard):
        self.inner = inner
        self.guard = guard

    async def write_layer(self, request_id, layer_idx, tensor, num_tokens):
        await self.inner.write_layer(request_id, layer_idx, tensor, num_tokens)

    async def write_scales(self, request_id, k_scales, v_scales):
        await self.inner.write_scales(request_id, k_scales, v_scales)

    async def release(self, request_id, transfer_id):
        await self.guard.idle(request_id)
        await self.inner.release(request_id, transfer_id)
