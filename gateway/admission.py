"""Delay-aware admission control: admit, queue until a deadline, or reject early.

Prediction (per candidate replica pair, see `Predictor`):
    TTFT = (max(queued prefill tokens on the replica, tokens the gateway has in flight there)
            + this prompt's uncached tokens) / prefill rate + transfer estimate + fixed overhead
    TPOT = decode step time at the replica's batch size + 1, inflated as KV usage nears full
Rates are EWMAs of the gateway's own observations (prefill compute time per prompt token
from PrefillResponse timings, decode token gaps); Load RPCs add queue lengths, batch sizes,
KV usage, measured step times, and a throughput floor for the prefill rate.

Calibration: each admitted request's prediction is compared with what it then got (TTFT from
the admit decision to its first token, TPOT over its whole stream). A `Calibrator` per quantity
keeps an EWMA of log(observed / raw prediction) and multiplies later predictions by its
exponential (clamped), so a model that is consistently off by a factor stops being off; it
also keeps the recent absolute percentage errors (exported as metrics).

Decision for one request with SLO (ttft_ms, tpot_ms) (a missing one uses the default; no SLO
at all means "admit whenever there is room"):
    predicted <= SLO                            -> admit
    even an idle replica would miss the SLO     -> reject now (RESOURCE_EXHAUSTED, reason)
    predicted TTFT late by more than the slack   -> reject now, Retry-After = predicted time
                                                   for the backlog ahead to drain
    otherwise (busy now, could fit later)       -> queue; re-decided on every load change, in
                                                   priority order, until the queue deadline
                                                   (arrival + SLO - idle TTFT), then reject.
Decode KV full (no free blocks) always queues: no room means no prefill.

Why TTFT lateness is rejected at once: a backlog drains at the rate the clock runs, so a
request predicted late now is predicted just as late after any wait (both sides of
`predicted TTFT <= SLO - waited` shrink together); waiting only helps within the predictor's
error, which is what the slack (a fraction of the SLO) allows for. TPOT lateness and a full
decode KV cache do resolve by waiting (requests finish), so those queue.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class LoadView:
    """What the gateway knows about one replica (built from LoadStats + own bookkeeping)."""
    queued_tokens: int = 0  # prefill: prompt tokens waiting; decode: reserved tokens
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    mean_step_ms: float | None = None
    tokens_per_s: float | None = None
    inflight_tokens: int = 0  # tokens the gateway has sent there and not seen finish
    inflight_requests: int = 0


class Ewma:
    def __init__(self, initial: float | None, alpha: float = 0.3):
        self.value = initial
        self.alpha = alpha
        self.samples = 0

    def update(self, x: float) -> float:
        if x is None or x != x or x <= 0:  # ignore NaN / non-positive measurements
            return self.value
        self.value = x if self.value is None or self.samples == 0 else \
            self.alpha * x + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


@dataclass
class AdmissionConfig:
    default_ttft_ms: float | None = None  # applied when a request gives none
    default_tpot_ms: float | None = None
    prefill_tokens_per_s: float = 2000.0  # prior until measured
    decode_step_ms: float = 20.0  # prior until measured (batch of 1)
    transfer_ms_per_token: float = 0.01  # prior until measured
    overhead_ms: float = 1.0
    max_queue_ms: float = 30000.0  # a request never waits longer than this in admission
    kv_high_watermark: float = 0.95
    batch_slowdown: float = 0.05  # per extra running sequence, fraction of the base step time
    # a request predicted to miss its TTFT SLO by more than this fraction of the SLO is
    # rejected at once (None: queue it until its deadline instead), once the TTFT predictor
    # has been checked against calibration_min_samples outcomes (until then it queues)
    early_reject_slack: float | None = 0.25
    calibrate: bool = True  # online correction of the predictions (see Calibrator)
    calibration_min_samples: int = 16

    def __post_init__(self):
        for k in ("prefill_tokens_per_s", "decode_step_ms"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be > 0")
        for k in ("default_ttft_ms", "default_tpot_ms"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ValueError(f"{k} must be > 0 when set")


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    idle_ttft_ms: float  # what an idle prefill replica would give (the best case)
    idle_tpot_ms: float
    decode_full: bool
    cached_tokens: int = 0  # prompt tokens expected from the replica's prefix cache
    ttft_factor: float = 1.0  # calibration applied (raw prediction = value / factor)
    tpot_factor: float = 1.0


@dataclass(frozen=True)
class Decision:
    kind: str  # "admit" | "queue" | "reject"
    reason: str
    prediction: Prediction | None = None
    retry_after_s: float = 0.0


class Calibrator:
    """Online correction of one predicted delay: `factor` = exp(EWMA of log(observed / raw
    prediction)), clamped to [1/max_factor, max_factor]; `errors` holds the recent absolute
    percentage errors |corrected - observed| / observed of the predictions actually used."""

    def __init__(self, alpha: float = 0.1, window: int = 256, max_factor: float = 4.0):
        self.alpha, self.max_log = alpha, math.log(max_factor)
        self.log_ratio = 0.0
        self.samples = 0
        self.errors: deque[float] = deque(maxlen=window)

    @property
    def factor(self) -> float:
        return math.exp(self.log_ratio)

    def observe(self, raw_ms: float, used_ms: float, observed_ms: float) -> float | None:
        """-> this sample's absolute percentage error (None for a sample that cannot count)."""
        if not (raw_ms > 0 and used_ms > 0 and observed_ms > 0) or math.isinf(observed_ms):
            return None
        r = math.log(observed_ms / raw_ms)
        a = 1.0 if self.samples == 0 else self.alpha
        self.log_ratio = min(self.max_log, max(-self.max_log, a * r + (1 - a) * self.log_ratio))
        self.samples += 1
        err = abs(used_ms - observed_ms) / observed_ms
        self.errors.append(err)
        return err

    def mape(self) -> float | None:
        """Median absolute percentage error over the window (a fraction; None before data)."""
        if not self.errors:
            return None
        xs = sorted(self.errors)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


class Predictor:
    """Measured rates (shared by all replicas of a role; a replica's own tokens_per_s wins)."""

    def __init__(self, cfg: AdmissionConfig):
        self.cfg = cfg
        self.prefill_rate = Ewma(cfg.prefill_tokens_per_s)  # prompt tokens / s
        self.decode_step = Ewma(cfg.decode_step_ms)  # ms per step at small batch
        self.transfer_per_token = Ewma(cfg.transfer_ms_per_token)
        self.ttft_cal = Calibrator()
        self.tpot_cal = Calibrator()

    # ---- observations
    def observe_prefill(self, num_tokens: int, prefill_ms: float, transfer_ms: float | None = None):
        if num_tokens > 0 and prefill_ms > 0:
            self.prefill_rate.update(num_tokens / (prefill_ms / 1e3))
        if transfer_ms is not None and num_tokens > 0:
            self.transfer_per_token.update(transfer_ms / num_tokens)

    def observe_decode_gap(self, gap_ms: float, batch: int) -> None:
        """A token gap measured at the gateway, normalised back to a batch of one."""
        self.decode_step.update(gap_ms / (1 + self.cfg.batch_slowdown * max(batch - 1, 0)))

    # ---- predictions
    def prefill_ms(self, prefill: LoadView, num_tokens: int,
                   cached_tokens: int = 0) -> tuple[float, float]:
        """-> (raw predicted ms until this prompt's first token, same on an idle replica);
        cached_tokens: prompt tokens the replica's prefix cache is expected to hold."""
        # NOTE: a replica's tokens_per_s is recent *throughput* (low when idle), not capacity;
        # it only raises the estimate (a saturated replica proves at least that rate)
        rate = max(self.prefill_rate.value, prefill.tokens_per_s or 0.0)
        new = max(num_tokens - cached_tokens, 1)
        transfer = self.transfer_per_token.value * num_tokens
        idle = new / rate * 1e3 + transfer + self.cfg.overhead_ms
        # NOTE: a prompt the gateway sent is in inflight_tokens (live) and, once the replica
        # queued it, in the polled queued_tokens too: the larger of the two, not their sum
        # (queued_tokens alone can exceed it when other clients feed the replica)
        ahead = max(prefill.queued_tokens, prefill.inflight_tokens)
        return ahead / rate * 1e3 + idle, idle

    def tpot_ms(self, decode: LoadView) -> tuple[float, float]:
        base = self.decode_step.value
        batch = max(decode.running, decode.inflight_requests) + 1
        tpot = base * (1 + self.cfg.batch_slowdown * (batch - 1))
        if decode.mean_step_ms and decode.running > 0:
            # measured at the current batch size: one more sequence adds one slowdown step
            tpot = max(tpot, decode.mean_step_ms * (1 + self.cfg.batch_slowdown))
        # near-full KV means preemption / waiting: inflate steeply above the watermark
        if decode.kv_usage > self.cfg.kv_high_watermark:
            tpot *= 1 + 10 * (decode.kv_usage - self.cfg.kv_high_watermark)
        return tpot, base

    def predict(self, prefill: LoadView, decode: LoadView, num_tokens: int,
                cached_tokens: int = 0) -> Prediction:
        """Calibrated prediction (the raw model times each Calibrator's factor)."""
        ttft, idle_ttft = self.prefill_ms(prefill, num_tokens, cached_tokens)
        tpot, idle_tpot = self.tpot_ms(decode)
        full = decode.num_free_blocks == 0 or decode.kv_usage >= 0.999
        ft = self.ttft_cal.factor if self.cfg.calibrate else 1.0
        fp = self.tpot_cal.factor if self.cfg.calibrate else 1.0
        return Prediction(ttft * ft, tpot * fp, idle_ttft * ft, idle_tpot * fp, full,
                          cached_tokens, ft, fp)

    def early_reject_slack(self) -> float | None:
        """The slack decide() may reject early with: none before the TTFT predictor is
        calibrated (an unchecked model must not turn requests away on its word alone)."""
        if self.ttft_cal.samples < self.cfg.calibration_min_samples:
            return None
        return self.cfg.early_reject_slack

    def observe_outcome(self, pred: Prediction, ttft_ms: float | None,
                        tpot_ms: float | None) -> tuple[float | None, float | None]:
        """What an admitted request got against its prediction -> (TTFT, TPOT) absolute
        percentage errors (None where there was nothing to compare)."""
        et = ep = None
        if ttft_ms is not None:
            et = self.ttft_cal.observe(pred.ttft_ms / pred.ttft_factor, pred.ttft_ms, ttft_ms)
        if tpot_ms is not None:
            ep = self.tpot_cal.observe(pred.tpot_ms / pred.tpot_factor, pred.tpot_ms, tpot_ms)
        return et, ep


def decide(pred: Prediction, ttft_slo_ms: float | None, tpot_slo_ms: float | None,
           waited_ms: float, max_queue_ms: float, early_reject_slack: float | None = None
           ) -> Decision:
    """Pure decision function (unit-tested alone). early_reject_slack: see AdmissionConfig."""
    if ttft_slo_ms is not None and pred.idle_ttft_ms > ttft_slo_ms:
        return Decision("reject", f"predicted TTFT {pred.idle_ttft_ms:.1f} ms even on an idle "
                        f"replica exceeds the requested ttft_ms={ttft_slo_ms:g}", pred,
                        retry_after_s=0.0)
    if tpot_slo_ms is not None and pred.idle_tpot_ms > tpot_slo_ms:
        return Decision("reject", f"predicted TPOT {pred.idle_tpot_ms:.1f} ms even on an idle "
                        f"replica exceeds the requested tpot_ms={tpot_slo_ms:g}", pred)
    # how long queueing may last before the TTFT SLO cannot be met any more
    budget = max_queue_ms
    if ttft_slo_ms is not None:
        budget = min(budget, ttft_slo_ms - pred.idle_ttft_ms)
    retry = max(pred.ttft_ms - pred.idle_ttft_ms, 100.0) / 1e3
    if pred.decode_full:
        if waited_ms >= budget:
            return Decision("reject", f"decode KV cache full for {waited_ms:.0f} ms (queue budget "
                            f"{budget:.0f} ms)", pred, retry_after_s=retry)
        return Decision("queue", "decode KV cache full", pred, retry_after_s=retry)
    late_ttft = ttft_slo_ms is not None and pred.ttft_ms > ttft_slo_ms - waited_ms
    late_tpot = tpot_slo_ms is not None and pred.tpot_ms > tpot_slo_ms
    if not late_ttft and not late_tpot:
        return Decision("admit", "predicted within SLO", pred)
    what = (f"predicted TTFT {pred.ttft_ms:.1f} ms > requested ttft_ms={ttft_slo_ms:g} - waited "
            f"{waited_ms:.0f} ms" if late_ttft else
            f"predicted TPOT {pred.tpot_ms:.1f} ms > requested tpot_ms={tpot_slo_ms:g}")
    if waited_ms >= budget:
        return Decision("reject", what + f" (queued {waited_ms:.0f} ms, no more time left)", pred,
                        retry_after_s=retry)
    if late_ttft and early_reject_slack is not None and \
            pred.ttft_ms - (ttft_slo_ms - waited_ms) > early_reject_slack * ttft_slo_ms:
        return Decision("reject", what + " (waiting would not help: the backlog drains as the "
                        "clock runs)", pred, retry_after_s=retry)
    return Decision("queue", what, pred, retry_after_s=retry)


@dataclass(order=True)
class _Waiter:
    sort_key: tuple
    event: asyncio.Event = field(compare=False)


class AdmissionQueue:
    """Requests waiting for admission, re-decided on `notify()` in order: higher priority
    first, then the earlier deadline, then arrival. Only the head may be admitted (a
    lower-priority request never overtakes a queued higher-priority one); every waiter
    re-decides on its own poll, so one whose deadline passed is rejected wherever it stands."""

    def __init__(self):
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def notify(self) -> None:
        if self._heap:
            self._heap[0].event.set()

    async def run(self, decide_fn, priority: int, poll_s: float = 0.05,
                  deadline: float = math.inf) -> Decision:
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
                try:
                    await asyncio.wait_for(w.event.wait(), poll_s)
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
