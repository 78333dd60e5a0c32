"""Decode yields its device to a prefill that shares it.

Two processes on one GPU (or one host's cores) time-slice it. While a prefill there works
through a burst of prompts for us, every decode step, a whole weight read whatever its batch,
takes about half the device, so the burst's last prompt is prefilled about twice as late as in
one engine that rides its decode rows along its prefill chunks, and the whole load ends later
(`python -m bench.pd_system`: the 64-client case). So while such a prefill has prompts for us in
flight, decode starts its steps at most every `ratio` x its own step time (the fastest of its
recent steps: the step alone, not sliced), and never further apart than `max_gap_s` or half the
tightest TPOT budget (DecodeRequest.tpot_ms) among the requests it runs. Between steps the
engine thread keeps taking commands (joins, aborts).

NOTE: "prompts for us in flight" counts every reservation whose KV has not landed, whichever
prefill will send it; with prefill replicas on other devices as well, decode also yields for
theirs (bounded by the same caps).
"""
from __future__ import annotations

import math
from typing import Callable


class StepPacer:
    """engine thread: delay(now, step_times) before each step; stepped(now) after launching it.
    event loop: add_budget / drop_budget (a request's TPOT budget, ms)."""

    def __init__(self, ratio: float, max_gap_s: float, active: Callable[[], bool]):
        if ratio < 0 or not math.isfinite(ratio):
            raise ValueError(f"ratio must be a finite number >= 0, got {ratio}")
        if max_gap_s < 0:
            raise ValueError(f"max_gap_s must be >= 0, got {max_gap_s}")
        self.ratio = ratio
        self.max_gap_s = max_gap_s
        self.active = active              # a co-resident prefill has prompts for us in flight
        self._budgets: dict[str, float] = {}
        self.budget_cap_s = math.inf      # half the tightest TPOT budget (set on the event loop)
        self._last_start: float | None = None
        self.paced_s = 0.0                # time the engine held back a step (stats)
        self.num_paced = 0                # steps started later than they could have

    @property
    def enabled(self) -> bool:
        return self.ratio > 0 and self.max_gap_s > 0

    # ---- event loop ------------------------------------------------------------------
    def add_budget(self, request_id: str, tpot_ms: float) -> None:
        if tpot_ms > 0:
            self._budgets[request_id] = tpot_ms / 1e3
            self._recap()

    def drop_budget(self, request_id: str) -> None:
        if self._budgets.pop(request_id, None) is not None:
            self._recap()

    def _recap(self) -> None:
        # NOTE: one float assignment: the engine thread reads it without a lock
        self.budget_cap_s = min(self._budgets.values()) / 2 if self._budgets else math.inf

    # ---- engine thread ---------------------------------------------------------------
    def interval(self, step_times: list[float]) -> float:
        """Seconds between step starts while yielding (0: do not yield)."""
        if not self.enabled or not step_times:
            return 0.0
        return min(self.ratio * min(step_times[-16:]), self.max_gap_s, self.budget_cap_s)

    def delay(self, now: float, step_times: list[float]) -> float:
        """Seconds to hold the next step back (0: run it now)."""
        if self._last_start is None or not self.enabled or not self.active():
            return 0.0
        return max(0.0, self._last_start + self.interval(step_times) - now)

    def stepped(self, now: float, waited_s: float) -> None:
        """A step starts at `now`, having been held back `waited_s`."""
        self._last_start = now
        if waited_s > 0:
            self.paced_s += waited_s
            self.num_paced += 1

    def stats(self) -> dict:
        return {"yield_seconds_total": round(self.paced_s, 6), "num_yielded_steps": self.num_paced}
