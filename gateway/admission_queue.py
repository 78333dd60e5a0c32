"""The admission queue: requests waiting for admission, re-decided in priority order."""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from gateway.admission import Decision


@dataclass(order=True)
class _Waiter:
    sort_key: tuple
    event: asyncio.Event = field(compare=False)


class AdmissionQueue:
    """Requests waiting for admission, re-decided on `notify()` in order: higher priority
    first, then the earlier deadline, then arrival. Only the head may be admitted (a
    lower-priority request never overtakes a queued higher-priority one). The head re-decides
    on every notify and every `poll_s`; the others only every `idle_poll_s` and at their
    deadline (so one whose deadline passed is rejected wherever it stands).
    NOTE: a waiter behind the head cannot be admitted, so its polls only look for a reason to
    reject; polled at `poll_s`, the decisions grow with the queue's depth (500 waiters: ~10,000
    a second on the gateway's event loop). `python -m bench.admission_queue` measures it."""

    def __init__(self):
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def notify(self) -> None:
        if self._heap:
            self._heap[0].event.set()

    async def run(self, decide_fn, priority: int, poll_s: float = 0.05,
                  deadline: float = math.inf, idle_poll_s: float = 0.5) -> Decision:
        """Call decide_fn(waited_ms) until it says admit/reject (it is called at least once).
        deadline: monotonic time after which the request cannot meet its SLO (orders the
        queue within a priority)."""
        t0 = time.monotonic()
        d = decide_fn(0.0)
        ahead = bool(self._heap) and -self._heap[0].sort_key[0] >= priority
        if d.kind == "reject" or (d.kind == "admit" and not ahead):
            return d
        w = _Waiter((-priority, deadline, next(self._seq)), asyncio.Event())
        heapq.heappush(self._heap, w)
        try:
            while True:
                timeout = poll_s
                if self._heap[0] is not w:
                    timeout = max(poll_s, min(idle_poll_s, deadline - time.monotonic()))
                try:
                    await asyncio.wait_for(w.event.wait(), timeout)
                    woken = True
                except asyncio.TimeoutError:
                    woken = False
                w.event.clear()
                head = self._heap[0] is w
                if not head and woken:
                    continue  # someone more important decides first
                d = decide_fn((time.monotonic() - t0) * 1e3)
                if d.kind == "reject" or (d.kind == "admit" and head):
                    return d
        finally:
            self._heap.remove(w)
            heapq.heapify(self._heap)
            self.notify()  # let the next one re-decide
