"""Per-token metrics of a decode step's streams, written to prometheus once per event-loop
wake-up instead of once per token: at 64 rows a step, prometheus_client's locked observe / inc
per token is about a fifth of decode's loop time a request-step, and that loop shares the GIL
with the engine thread (`python -m lab.decode_stream_probe --mode batched` measures it).

The values land at the end of the wake-up that produced them (`loop.call_soon`), so a scrape
never misses more than the step in flight.
"""
from __future__ import annotations

import asyncio
from bisect import bisect_left


def observe_many(hist, values: list[float]) -> None:
    """hist.observe(v) for each v, as one update per touched bucket. Uses prometheus_client's
    unlabelled Histogram internals (`_upper_bounds`, `_buckets`, `_sum`, not buckets cumulated);
    where they are not there (another version, a labelled parent) it observes one by one."""
    bounds, buckets, total = (getattr(hist, "_upper_bounds", None), getattr(hist, "_buckets", None),
                              getattr(hist, "_sum", None))
    if not values:
        return
    if bounds is None or buckets is None or total is None or len(buckets) != len(bounds):
        for v in values:
            hist.observe(v)
        return
    total.inc(sum(values))
    counts = [0] * len(bounds)
    last = len(bounds) - 1
    for v in values:
        i = bisect_left(bounds, v)
        counts[i if i < last else last] += 1  # NOTE: the last bound is +Inf
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


class StepTally:
    """Gathers inter-token gaps and generated-token counts from the streams a wake-up serves
    and writes them once at its end. Loop thread only (no lock)."""

    def __init__(self, itl, generation_tokens):
        self.itl, self.generation_tokens = itl, generation_tokens
        self._gaps: list[float] = []
        self._tokens = 0
        self._scheduled = False

    def add(self, gap_s: float | None, tokens: int) -> None:
        """One stream's output: the gap since its last token (None: its first), its tokens."""
        if gap_s is not None:
            self._gaps.append(gap_s)
        self._tokens += tokens
        if self._scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            self._scheduled = True
        except RuntimeError:  # no loop (a synchronous caller): write now
            self.flush()

    def flush(self) -> None:
        self._scheduled = False
        gaps, self._gaps = self._gaps, []
        n, self._tokens = self._tokens, 0
        if n:
            self.generation_tokens.inc(n)
        observe_many(self.itl, gaps)
