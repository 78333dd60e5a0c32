"""The admission decision for one request from its prediction: admit, queue until a deadline, or
reject early (a pure function, unit-tested alone).

Decision for one request with SLO (ttft_ms, tpot_ms) (a missing one uses the default; no SLO
at all means "admit whenever there is room"):
    predicted <= SLO                            -> admit
    even an idle replica would miss the SLO     -> reject now (RESOURCE_EXHAUSTED, reason)
    predicted TTFT late by more than the slack   -> reject now, Retry-After = predicted time
                                                   for the backlog ahead to drain
    otherwise (busy now, could fit later)       -> queue; re-decided on every load change, in
                                                   priority order, until the queue deadline
                                                   (arrival + SLO - idle TTFT), then reject.
Decode full (no free KV blocks, or its batch at its sequence cap) always queues: no room means
no prefill.

Why TTFT lateness is rejected at once: a backlog drains at the rate the clock runs, so a
request predicted late now is predicted just as late after any wait (both sides of
`predicted TTFT <= SLO - waited` shrink together); waiting only helps within the predictor's
error, which is what the slack (a fraction of the SLO) allows for. The slack defaults to 0:
a late request re-decided on every load change is admitted the moment a noisy prediction dips,
i.e. on exactly the estimates that are too low, and misses its SLO. TPOT lateness and a full
decode KV cache do resolve by waiting (requests finish), so those queue.
"""
from __future__ import annotations

from gateway.admission_types import Decision, Prediction


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
            return Decision("reject", f"decode full (KV blocks or batch slots) for {waited_ms:.0f} ms (queue budget "
                            f"{budget:.0f} ms)", pred, retry_after_s=retry)
        return Decision("queue", "decode full (KV blocks or batch slots)", pred, retry_after_s=retry)
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
