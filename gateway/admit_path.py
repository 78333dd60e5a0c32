"""The admission half of GatewayCore's path (a mixin): the admit / queue / reject decision for
one request (gateway/admission.py's models over the replicas' loads, the idle probe, the
running requests' TPOT SLOs) and the comparison of each admitted request's prediction with
what it got (calibration and the prediction-error metrics)."""
from __future__ import annotations

import logging
import math
import time

import grpc

from common import telemetry
from gateway.admission import Decision, LoadView, decide
from gateway.routing import Route, order_decode, order_prefill
from gateway.types import GatewayError, GenRequest

log = logging.getLogger("splitserve.gateway.core")
# an idle probe is admitted while the raw idle model is at most this many times its SLO: a fit
# off by that much recovers from the probe's outcome; a tiny SLO is still rejected at once
PROBE_FACTOR = 4.0


class AdmitPath:
    """Needs (from GatewayCore): admission_cfg, predictor, queue, prefix, metrics, prefill,
    decode, num_admitted."""

    def _slos(self, req: GenRequest) -> tuple[float | None, float | None]:
        cfg = self.admission_cfg
        return (req.ttft_slo_ms if req.ttft_slo_ms is not None else cfg.default_ttft_ms,
                req.tpot_slo_ms if req.tpot_slo_ms is not None else cfg.default_tpot_ms)

    def _decide(self, req: GenRequest, waited_ms: float, route: Route | None = None) -> Decision:
        route = route if route is not None else Route()
        ids = req.prompt_token_ids
        n = len(ids)
        if route.hashes is None:
            route.hashes = self.prefix.hashes(ids)
        cached = {r.address: self.prefix.match(r.address, route.hashes, n)
                  for r in self.prefill.replicas}
        p = order_prefill(self.prefill.replicas, self.predictor, n, cached)[0]
        d = order_decode(self.decode.replicas, self.predictor)[0]
        route.prefill, route.cached = p, cached[p.address]
        route.here = d if self._prefills_here(p, d) else None
        # admitted requests still prefilling join a decode batch before this one would
        joining = sum(r.load.inflight_requests for r in self.prefill.replicas) // max(
            1, sum(r.healthy for r in self.decode.replicas))
        if route.here is None:
            ahead = p.clock.ahead(time.monotonic(), p.load.max_batched_tokens, p.load.queued_tokens)
            pred = self.predictor.predict(p.load, d.load, n, route.cached, joining, ahead=ahead)
        else:
            # prefilled in the decode replica's own steps: the prompts ahead are the ones sent
            # there and not yet past their first token (counted on it from the admit decision)
            ahead = LoadView(inflight_tokens=d.load.inflight_tokens)
            pred = self.predictor.predict(ahead, d.load, n, 0, joining, here=True)
        ttft, tpot = self._slos(req)
        cfg = self.admission_cfg
        dec = decide(pred, ttft, tpot, waited_ms, cfg.max_queue_ms, self.predictor.early_reject_slack())
        idle = self.num_admitted == 0 and not (p.load.queued_tokens or p.load.waiting
                                               or d.load.running or pred.decode_full)
        if dec.kind != "admit" and idle:
            # NOTE: the replicas are idle, so admitting hurts no one, and only outcomes refresh
            # the models: a calibration or fit learned under a load or a stall that is gone
            # (a cold engine's first steps, a host busy with other work) must not turn every
            # request away for good. Still rejected: an SLO the uncalibrated model misses by
            # more than PROBE_FACTOR even idle (a tiny SLO).
            k = PROBE_FACTOR
            idle_p = self.predictor.tpot_ms(d.load)[1]
            idle_t = (self.predictor.prefill_ms(LoadView(), n, here=True)[1] + idle_p if route.here else
                      self.predictor.prefill_ms(p.load, n, route.cached)[1])
            if (ttft is None or idle_t <= k * ttft) and (tpot is None or idle_p <= k * tpot):
                return Decision("admit", "idle probe: nothing admitted is running", pred)
        # one more sequence slows every running one: the tightest TPOT SLO there must hold too
        # (waiting helps: running requests finish)
        tight = d.tightest_tpot_ms() if dec.kind == "admit" else None
        if tight is not None and pred.tpot_ms > tight:
            what = (f"predicted TPOT {pred.tpot_ms:.1f} ms would slow a running request past its "
                    f"tpot_ms={tight:g}")
            budget = min(cfg.max_queue_ms, ttft - pred.idle_ttft_ms if ttft is not None else math.inf)
            if waited_ms >= budget:
                return Decision("reject", what + f" (queued {waited_ms:.0f} ms, no more time left)",
                                pred, retry_after_s=1.0)
            return Decision("queue", what, pred, retry_after_s=1.0)
        return dec

    async def admit(self, req: GenRequest, route: Route | None = None) -> Decision:
        """Admit (route filled in, the prompt counted in its prefill replica's in-flight
        tokens), or raise RESOURCE_EXHAUSTED with a Retry-After from the prediction."""
        route = route if route is not None else Route()
        with telemetry.span("gateway.admission") as sp:
            queued = False

            def fn(waited_ms: float) -> Decision:
                nonlocal queued
                d = self._decide(req, waited_ms, route)
                if d.kind == "queue" and not queued:
                    queued = True
                    self.metrics.admission.labels(decision="queue").inc()
                    self.metrics.waiting.inc()
                return d

            ttft_slo, _ = self._slos(req)
            budget = min(ttft_slo if ttft_slo is not None else math.inf,
                         self.admission_cfg.max_queue_ms)
            try:
                d = await self.queue.run(fn, req.priority, deadline=req.arrival + budget / 1e3)
            finally:
                if queued:
                    self.metrics.waiting.dec()
            self.metrics.admission.labels(decision=d.kind).inc()
            if d.prediction is not None:
                self.metrics.predicted_ttft.observe(d.prediction.ttft_ms / 1e3)
                self.metrics.predicted_tpot.observe(d.prediction.tpot_ms / 1e3)
                telemetry.set_attrs(sp, {"splitserve.predicted_ttft_ms": d.prediction.ttft_ms,
                                         "splitserve.predicted_tpot_ms": d.prediction.tpot_ms,
                                         "splitserve.predicted_cached_tokens": route.cached})
            sp.set_attribute("splitserve.admission.decision", d.kind)
            sp.set_attribute("splitserve.admission.queued", queued)
            if d.kind == "reject":
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"admission rejected request {req.request_id}: {d.reason}",
                                   retry_after_s=max(d.retry_after_s, 1.0))
            route.prediction, route.t_decided = d.prediction, time.monotonic()
            route.admitted = True
            self.num_admitted += 1
            if route.here is not None:
                route.inflight = len(req.prompt_token_ids)
                route.alone = route.here.load.inflight_tokens == 0
                route.inflight_key = route.here.add_inflight(route.inflight)
            else:
                route.inflight = max(len(req.prompt_token_ids) - route.cached, 1)
                route.inflight_key = route.prefill.add_inflight(route.inflight)
            return d

    def _observe_slo(self, req: GenRequest, route: Route, ttft_ms: float | None = None,
                     tpot_ms: float | None = None) -> None:
        """An admitted request's TTFT (from arrival) / TPOT against its SLOs: the guards (only
        when they are on: off, nothing reads them)."""
        if route.prediction is None or not self.admission_cfg.guard_fed:
            return
        ttft_slo, tpot_slo = self._slos(req)
        p = self.predictor
        p.observe_slo(ttft_ms, ttft_slo, tpot_ms, tpot_slo)
        for what, g in (("ttft", p.ttft_guard), ("tpot", p.tpot_guard)):
            self.metrics.prediction_correction.labels(what=what, term="guard").set(g.factor)

    def _observe_outcome(self, req: GenRequest, route: Route, ttft_ms: float | None,
                         tpot_ms: float | None) -> None:
        """One admitted request's prediction against what it got: calibration + metrics."""
        pred = route.prediction
        if pred is None:
            return
        et, ep = self.predictor.observe_outcome(pred, ttft_ms, tpot_ms)
        m = self.metrics
        est_t = pred.est_ttft_ms if pred.est_ttft_ms is not None else pred.ttft_ms
        est_p = pred.est_tpot_ms if pred.est_tpot_ms is not None else pred.tpot_ms
        for what, err, got, want, cal in (("ttft", et, ttft_ms, est_t, self.predictor.ttft_cal),
                                          ("tpot", ep, tpot_ms, est_p, self.predictor.tpot_cal)):
            if err is None:
                continue
            m.prediction_ratio.labels(what=what).observe(got / want)
            m.prediction_mape.labels(what=what).set(cal.mape())
            offset, scale = cal.coef()
            m.prediction_correction.labels(what=what, term="scale").set(scale)
            m.prediction_correction.labels(what=what, term="offset_ms").set(offset)
            log.debug("request %s %s predicted %.1f ms, got %.1f ms (%.0f%% off)", req.request_id,
                      what.upper(), want, got, err * 100)
