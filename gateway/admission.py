"""Delay-aware admission control: admit, queue until a deadline, or reject early.

Prediction (per candidate replica pair, see `Predictor`):
    TTFT = (max(queued prefill tokens there, tokens the gateway has admitted there and not
            seen finish) + this prompt's uncached tokens) / prefill rate + transfer + overhead
    TPOT = decode step time at the batch (running + admitted still prefilling + 1), inflated
           as KV usage nears full
Fitted online: prefill ms = a + b * new tokens (PrefillResponse timings; `RobustLinear`), the
same for KV handoff ms and for prompts a decode replica prefills itself (their first tokens),
decode step ms = a + b * batch (the gateway's token gaps; `OnlineLinear`); Load adds the rest.
TTFT, once `TtftFit` has outcomes (`--admission-ttft-model fit`, the default): a fit of observed
TTFT against the prefill engine's steps ahead (gateway/ttft_fit.py: the rest of the running
step, the tokens queued, the prompt's own, the prompts expected to join its step), replacing
the queue model and its correction below, which stay the fallback (`queue`: them alone).

Calibration: each admitted request's prediction is compared with what it then got (TTFT from
the admit decision to its first token, TPOT over its stream). A `Calibrator` per quantity
corrects it per load bucket (TTFT: work queued ahead relative to the prompt's own; TPOT: the
batch): corrected = offset + factor * raw, the offset (TTFT) learned with nothing queued ahead,
the factor bounded to [1/2, 2], so the correction can never turn into a constant. Decisions use
the corrected estimate times a headroom (the `--slo-attainment` quantile, 0.95 by default, of
the bucket's recent observed / estimated ratios, >= 1) so admitted requests meet their SLO, not
just half of them; a nearly idle replica gets none: it covers queueing error, and a request
that meets its SLO with no queue must not be turned away at low load. The ratios come back only
as requests finish and cover only what the models see; an `AttainmentGuard` per SLO closes the
loop on the outcome itself (met or missed), scaling the loaded predictions until the admitted
requests' miss rate is what `--slo-attainment` allows (`--admission-guard`; by default on
for decode replicas on a GPU only).

The decision on a prediction: gateway/decide.py.
"""
from __future__ import annotations

import math

from gateway.admission_types import TTFT_MODELS, AdmissionConfig, Decision, LoadView, Prediction
from gateway.calibration import AttainmentGuard, Calibrator, OnlineLinear, RobustLinear
from gateway.decide import decide
from gateway.prefill_clock import Ahead
from gateway.ttft_fit import TtftFit

__all__ = ["TTFT_MODELS", "AdmissionConfig", "Decision", "LoadView", "Prediction", "Predictor",
           "decide"]

YOUNG_FIT = 8  # prefill samples before the fit alone predicts (see observe_prefill)
TTFT_FACTOR_WINDOW = 64  # outcomes per bucket the TTFT correction is the median of


class Predictor:
    """Fitted delay models shared by all replicas of a role (a replica's own tokens_per_s is a
    floor on the prefill rate): prefill ms = a + b * new tokens (PrefillResponse timings),
    decode step ms = a + b * batch (the gateway's token gaps at the polled batch size); then
    the Calibrators' corrections of the whole predicted TTFT / TPOT."""

    def __init__(self, cfg: AdmissionConfig):
        self.cfg = cfg
        per_token = 1e3 / cfg.prefill_tokens_per_s
        self.prefill_fit = RobustLinear(0.0, per_token)
        s = cfg.batch_slowdown * cfg.decode_step_ms
        self.step_fit = OnlineLinear(cfg.decode_step_ms - s, s)
        # KV handoff ms = a + b * new tokens: the blocks a cached prefix spares the prefill
        # mostly spare the handoff too, and its fixed cost (an RPC, a map) is no per-token rate
        self.transfer_fit = RobustLinear(0.0, cfg.transfer_ms_per_token)
        # prompts a decode replica prefills in its own steps (--prefill-on-decode): another
        # engine, often the only one prefilling (auto on one GPU), so a fit of its own
        self.here_fit = RobustLinear(0.0, per_token)
        # a bucket's factor is the median of its recent ratios, steadier than an EWMA under
        # queueing (measured by `python -m lab.admission_replay RUN.json`)
        self.ttft_cal = Calibrator(additive=True, factor_window=TTFT_FACTOR_WINDOW)
        # TPOT: a step time scales with the batch; no idle-only fixed cost to learn apart
        self.tpot_cal = Calibrator(additive=False)
        self.ttft_fit = TtftFit(per_token)
        q = cfg.headroom_quantile
        target = (1.0 + q) / 2 if q is not None else 0.975
        self.ttft_guard, self.tpot_guard = AttainmentGuard(target), AttainmentGuard(target)

    # ---- observations
    def observe_prefill(self, num_tokens: int, prefill_ms: float, transfer_ms: float | None = None):
        """num_tokens: the prompt's new (uncached) tokens; the replica's prefill and KV handoff ms."""
        if num_tokens > 0 and prefill_ms > 0:
            # NOTE: a cold engine's first prompts (graph capture, kernel JIT) take seconds: the
            # robust fit outvotes them once warm samples outnumber them, and until it has
            # YOUNG_FIT samples no prediction is slower than the fastest sample's rate
            self.prefill_fit.add(num_tokens, prefill_ms)
        if transfer_ms is not None and transfer_ms >= 0 and num_tokens > 0:
            self.transfer_fit.add(num_tokens, transfer_ms)

    def observe_prefill_here(self, num_tokens: int, ttft_ms: float, step_ms: float) -> None:
        """A prompt a decode replica prefilled with nothing else of ours ahead: its TTFT from the
        admit decision less the decode step the prediction adds (`predict(here=True)`)."""
        if num_tokens > 0 and ttft_ms > 0 and math.isfinite(ttft_ms):
            self.here_fit.add(num_tokens, max(ttft_ms - max(step_ms, 0.0), 0.1 * ttft_ms))

    def observe_decode_gap(self, gap_ms: float, batch: int) -> None:
        """A token gap measured at the gateway at a (polled) decode batch size."""
        if gap_ms > 0 and math.isfinite(gap_ms):
            # NOTE: one gap can hold a stall (a KV import, a new request joining): clip it so
            # a rare outlier moves the fit by a bounded amount (never below 0: a clip that
            # follows a fit gone low fed it ever lower samples until it overflowed to NaN)
            cap = 2 * self.step_fit(batch)
            self.step_fit.add(batch, min(gap_ms, cap) if cap > 0 else gap_ms)

    # ---- predictions
    def prefill_ms(self, prefill: LoadView, num_tokens: int, cached_tokens: int = 0,
                   here: bool = False) -> tuple[float, float]:
        """-> (raw predicted ms until this prompt's first token, same on an idle replica);
        cached_tokens: prompt tokens the replica's prefix cache is expected to hold; here: a
        decode replica prefills it (its own fit, no KV handoff).
        raw = queue wait (prompt tokens ahead on the replica / prefill rate) + own prefill
        (a + b * new tokens) + KV handoff + fixed overhead."""
        fit = self.here_fit if here else self.prefill_fit
        a, per_token = fit.coef() if here else self._per_token(prefill)
        new = max(num_tokens - cached_tokens, 1)
        own = max(a, 0.0) + new * per_token
        r = fit.min_ratio() if fit.samples < YOUNG_FIT else None
        if r is not None:  # a young fit may hold only a cold engine's seconds: bound it
            own, per_token = min(own, new * r), min(per_token, r)
        transfer = 0.0 if here else max(self.transfer_fit(new), 0.0)
        idle = own + transfer + self.cfg.overhead_ms
        return self.tokens_ahead(prefill) * per_token + idle, idle

    def _per_token(self, prefill: LoadView) -> tuple[float, float]:
        a, per_token = self.prefill_fit.coef()
        if prefill.tokens_per_s:
            # NOTE: a replica's tokens_per_s is recent *throughput* (low when idle), not
            # capacity; it only lowers the cost (a saturated replica proves at least that rate)
            per_token = min(per_token, 1e3 / prefill.tokens_per_s)
        return a, per_token

    @staticmethod
    def tokens_ahead(prefill: LoadView) -> int:
        # NOTE: a prompt the gateway sent is in inflight_tokens (live, counted from the admit
        # decision: admitted but not started too) and, once the replica queued it, in the
        # polled queued_tokens as well: the larger of the two, not their sum (queued_tokens
        # alone can exceed it when other clients feed the replica)
        return max(prefill.queued_tokens, prefill.inflight_tokens)

    def ttft_bucket(self, prefill: LoadView, num_tokens: int, cached_tokens: int = 0) -> int:
        """Calibration bucket: prefill work queued ahead / the prompt's own: 0, <= 1, <= 4, more."""
        ahead, own = self.tokens_ahead(prefill), max(num_tokens - cached_tokens, 1)
        return 0 if ahead <= 0 else 1 if ahead <= own else 2 if ahead <= 4 * own else 3

    @staticmethod
    def tpot_bucket(batch: int) -> int:
        """Calibration bucket by decode batch size (1-2, 3-8, 9-32, more)."""
        return 0 if batch <= 2 else 1 if batch <= 8 else 2 if batch <= 32 else 3

    def decode_batch(self, decode: LoadView, joining: int = 0) -> int:
        """The batch this request decodes in: running (or sent there), the requests admitted
        and still prefilling (`joining`: they reach the batch before this one), and itself."""
        return max(decode.running, decode.inflight_requests) + max(joining, 0) + 1

    def tpot_ms(self, decode: LoadView, joining: int = 0) -> tuple[float, float]:
        batch = self.decode_batch(decode, joining)
        base = self.step_fit(1)
        tpot = max(self.step_fit(batch), base)
        if decode.mean_step_ms and decode.running > 0:
            # measured at the current batch size: each sequence more adds one slowdown step
            extra = batch - decode.running
            tpot = max(tpot, decode.mean_step_ms * (1 + self.cfg.batch_slowdown * extra))
        # near-full KV means preemption / waiting: inflate steeply above the watermark
        if decode.kv_usage > self.cfg.kv_high_watermark:
            tpot *= 1 + 10 * (decode.kv_usage - self.cfg.kv_high_watermark)
        return tpot, base

    def predict(self, prefill: LoadView, decode: LoadView, num_tokens: int,
                cached_tokens: int = 0, joining: int = 0, here: bool = False,
                ahead: Ahead | None = None) -> Prediction:
        """Calibrated prediction (the raw models corrected by the Calibrators, or TtftFit's
        TTFT). joining: admitted requests still prefilling that will join this decode replica's
        batch; here: the decode replica prefills it, so its first token also waits for a decode
        step; ahead: the prefill replica's steps ahead (PrefillClock), which TtftFit needs."""
        ttft, idle_ttft = self.prefill_ms(prefill, num_tokens, cached_tokens, here)
        tpot, idle_tpot = self.tpot_ms(decode, joining)
        if here:
            ttft, idle_ttft = ttft + tpot, idle_ttft + idle_tpot
        batch = self.decode_batch(decode, joining)
        # NOTE: a batch at its sequence cap is full like a KV cache without blocks: a request
        # admitted past it waits in decode for a slot after its first token, and that wait
        # (seconds at 2x overload) lands in its TPOT, which no step-time model predicts
        full = (decode.num_free_blocks == 0 or decode.kv_usage >= 0.999
                or (decode.max_num_seqs is not None and batch > decode.max_num_seqs))
        bt = self.ttft_bucket(prefill, num_tokens, cached_tokens)
        bp = self.tpot_bucket(batch)
        x = fit = None
        if ahead is not None and not here:
            x = self.ttft_fit.sample(ahead, num_tokens - cached_tokens)
            fit = self.ttft_fit.predict(x)
        more = dict(ahead=ahead, ttft_sample=x, fit_ttft_ms=fit, decode_batch=batch)
        if not self.cfg.calibrate:
            return Prediction(ttft, tpot, idle_ttft, idle_tpot, full, cached_tokens, ttft, tpot,
                              ttft_bucket=bt, tpot_bucket=bp, **more)
        tc, pc = self.ttft_cal, self.tpot_cal
        et, ep = tc.correct(ttft, bt), pc.correct(tpot, bp)
        if fit is not None and self.cfg.ttft_model == "fit":
            # NOTE: bounded by the queue model (half its idle part, 4x the whole): a fit of a few
            # hundred outcomes may refine it, never swing past it on a configuration unseen
            et = min(max(fit, idle_ttft / 2), 4 * ttft)
        q = self.cfg.headroom_quantile
        # NOTE: no headroom when nearly idle (work ahead <= the prompt's own; batch <= 2)
        ht = tc.headroom(q, bt) if bt >= 2 else 1.0
        hp = pc.headroom(q, bp) if bp >= 1 else 1.0
        if self.cfg.guard_on(decode.device_id):  # not when nearly idle either: it answers to queueing and batching
            ht *= self.ttft_guard.factor if bt >= 1 else 1.0
            hp *= self.tpot_guard.factor if bp >= 1 else 1.0
        # NOTE: idle estimates only reject: the more optimistic of model and correction, so a
        # stale correction cannot turn requests away at low load
        return Prediction(et * ht, ep * hp, min(idle_ttft, tc.correct(idle_ttft, 0)),
                          min(idle_tpot, pc.correct(idle_tpot, 0)), full,
                          cached_tokens, ttft, tpot, et, ep, bt, bp, **more)

    def early_reject_slack(self) -> float | None:
        """The slack decide() may reject early with: none before the TTFT predictor is
        calibrated (an unchecked model must not turn requests away on its word alone)."""
        if self.ttft_cal.samples < self.cfg.calibration_min_samples:
            return None
        return self.cfg.early_reject_slack

    def observe_slo(self, ttft_ms: float | None, ttft_slo_ms: float | None,
                    tpot_ms: float | None = None, tpot_slo_ms: float | None = None) -> None:
        """An admitted request's TTFT (from its arrival) or TPOT against its SLO: the guards."""
        if ttft_ms is not None and ttft_slo_ms is not None:
            self.ttft_guard.observe(ttft_ms, ttft_slo_ms)
        if tpot_ms is not None and tpot_slo_ms is not None:
            self.tpot_guard.observe(tpot_ms, tpot_slo_ms)

    def observe_outcome(self, pred: Prediction, ttft_ms: float | None,
                        tpot_ms: float | None) -> tuple[float | None, float | None]:
        """What an admitted request got against its prediction -> (TTFT, TPOT) absolute
        percentage errors (None where there was nothing to compare)."""
        et = ep = None
        if ttft_ms is not None and pred.ttft_sample is not None:
            self.ttft_fit.add(pred.ttft_sample, ttft_ms)
        if ttft_ms is not None:
            est = pred.est_ttft_ms if pred.est_ttft_ms is not None else pred.ttft_ms
            raw = pred.raw_ttft_ms if pred.raw_ttft_ms is not None else est
            et = self.ttft_cal.observe(raw, est, ttft_ms, pred.ttft_bucket)
        if tpot_ms is not None:
            est = pred.est_tpot_ms if pred.est_tpot_ms is not None else pred.tpot_ms
            raw = pred.raw_tpot_ms if pred.raw_tpot_ms is not None else est
            ep = self.tpot_cal.observe(raw, est, tpot_ms, pred.tpot_bucket)
        return et, ep
