"""Calibrated admission: online correction of the predictions, their error, early rejection
once calibrated, deadline order in the queue; through GatewayCore on fake services."""
import asyncio
import math
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.admission import AdmissionConfig, Decision, LoadView, Prediction, Predictor, decide
from gateway.admission_queue import AdmissionQueue
from gateway.calibration import Calibrator, OnlineLinear
from gateway.types import GatewayError, GenRequest
from tests.gateway.conftest import make_stack


def test_online_linear_fits_and_keeps_the_prior_slope_without_spread():
    f = OnlineLinear(0.0, 1.0)
    assert f(50) == pytest.approx(50.0)
    for x in (10, 40, 80) * 30:
        f.add(x, 30.0 + 0.5 * x)
    a, b = f.coef()
    assert a == pytest.approx(30.0, rel=0.02) and b == pytest.approx(0.5, rel=0.02)
    g = OnlineLinear(0.0, 2.0)
    for _ in range(60):  # every sample at one x: the slope cannot be fitted
        g.add(4, 20.0)
    assert g.coef()[1] == pytest.approx(2.0) and g(4) == pytest.approx(20.0)


def test_calibrator_learns_an_idle_offset_and_a_factor_per_bucket_and_reports_error():
    c = Calibrator()
    assert c.correct(100.0) == 100.0 and c.mape() is None
    for raw in (50.0, 100.0, 200.0) * 40:  # reality: 40 ms the model misses, 1.5 x under load
        c.observe(raw, c.correct(raw, 0), 40.0 + raw, bucket=0)
        c.observe(raw, c.correct(raw, 2), 40.0 + 1.5 * raw, bucket=2)
    assert c.correct(100.0, 0) == pytest.approx(140.0, rel=0.02)
    assert c.correct(100.0, 2) == pytest.approx(190.0, rel=0.02)
    assert c.correct(100.0, 3) == pytest.approx(c.correct(100.0, 1))  # unseen: pooled factor
    off, scale = c.coef()
    assert off == pytest.approx(40.0, rel=0.02) and scale == pytest.approx(1.5, rel=0.02)
    assert c.errors[-1] < 0.02 and c.mape() < 0.05
    assert c.observe(0.0, 1.0, 1.0) is None and c.observe(1.0, 1.0, math.inf) is None


def test_calibrator_cannot_collapse_into_a_constant_and_is_clamped():
    c = Calibrator()
    for raw in (50.0, 100.0, 200.0, 400.0) * 40:  # outcomes that ignore the model entirely
        c.observe(raw, c.correct(raw, 2), 150.0, bucket=2)
    lo, hi = c.correct(50.0, 2), c.correct(400.0, 2)
    assert hi - lo >= (400.0 - 50.0) / 2  # the slope on the model stays >= 1 / max_factor
    big = Calibrator(max_factor=2.0, max_offset_ms=500.0)
    for _ in range(400):
        big.observe(10.0, 10.0, 1e6, bucket=0)
        big.observe(10.0, 10.0, 1e6, bucket=3)
    assert big.offset == pytest.approx(500.0, rel=0.01) and big.factor(3) == pytest.approx(2.0, rel=0.01)
    assert big.correct(10.0, 3) <= 10.0 * 2.0 + 500.0
    one = Calibrator()
    for _ in range(30):
        one.observe(100.0, 100.0, 120.0, bucket=0)
    one.observe(100.0, 100.0, 1e5, bucket=0)  # one stalled request
    assert one.offset < 20.0 + 0.15 * (2 * 100.0 + 10.0) + 1e-6


def test_predictor_converges_on_synthetic_step_times_at_every_load():
    """Reality: prefill 5 ms + 0.2 ms/token, a 30 ms fixed cost the model has no term for,
    the queue ahead drains at the same rate, +-10% noise; the predictor sees only the
    PrefillResponse-like timings of requests alone and each outcome."""
    import random

    rnd = random.Random(0)
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=2000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=1.0))
    errs = {0: [], 1: [], 2: [], 3: []}
    for i in range(600):
        n = rnd.choice((64, 128, 256, 512))
        ahead = rnd.choice((0, 0, n // 2, 2 * n, 8 * n))
        compute = 5.0 + 0.2 * n
        if ahead == 0:
            p.observe_prefill(n, compute * rnd.uniform(0.95, 1.05))
        pr = p.predict(LoadView(queued_tokens=ahead), LoadView(), n)
        got = (30.0 + compute + 0.2 * ahead) * rnd.uniform(0.9, 1.1)
        e, _ = p.observe_outcome(pr, got, None)
        if i >= 300:
            errs[pr.ttft_bucket].append(e)
    for b, xs in errs.items():
        assert len(xs) > 20 and sorted(xs)[len(xs) // 2] < 0.1, (b, sorted(xs)[len(xs) // 2])
    assert p.ttft_cal.offset == pytest.approx(30.0, abs=8.0)
    assert 0.8 < p.ttft_cal.factor(3) < 1.25


def test_a_nearly_idle_replica_admits_on_the_estimate_alone():
    """Headroom learned under load (every loaded estimate 1.8 x too low at times) must not
    turn away a request that meets its SLO with no queue."""
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    for i in range(64):
        pr = p.predict(LoadView(queued_tokens=1000), LoadView(), 100)
        p.observe_outcome(pr, pr.est_ttft_ms * (1.8 if i % 2 else 0.6), None)
    loaded = p.predict(LoadView(queued_tokens=1000), LoadView(), 100)
    assert loaded.ttft_ms > 1.5 * loaded.est_ttft_ms  # headroom where there is a queue
    idle = p.predict(LoadView(), LoadView(), 100)
    assert idle.ttft_bucket == 0 and idle.ttft_ms == idle.est_ttft_ms == pytest.approx(100.0)
    near = p.predict(LoadView(inflight_tokens=50), LoadView(), 100)
    assert near.ttft_bucket == 1 and near.ttft_ms == near.est_ttft_ms
    slo = 1.05 * near.est_ttft_ms
    assert decide(near, slo, None, 0, 30000, p.early_reject_slack()).kind == "admit"
    assert decide(idle, slo, None, 0, 30000, p.early_reject_slack()).kind == "admit"
    assert decide(idle, 90.0, None, 0, 30000, 0.0).kind == "reject"  # even idle misses


def test_predictor_applies_and_learns_the_correction():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0, decode_step_ms=10.0))
    first = p.predict(LoadView(), LoadView(), 100)
    assert first.ttft_ms == pytest.approx(100.0) and first.raw_ttft_ms == pytest.approx(100.0)
    for q in (0, 100, 300) * 20:  # everything takes twice as long as modelled
        pr = p.predict(LoadView(queued_tokens=q), LoadView(), 100)
        p.observe_outcome(pr, 2 * pr.raw_ttft_ms, 20.0)
    pr = p.predict(LoadView(), LoadView(), 100)
    assert pr.ttft_ms == pytest.approx(200.0, rel=0.02) and pr.tpot_ms == pytest.approx(20.0, rel=0.02)
    # the idle estimate (it only rejects) is the more optimistic of model and correction
    assert pr.idle_ttft_ms == pytest.approx(100.0)
    assert max(list(p.ttft_cal.errors)[-10:]) < 0.05 and p.ttft_cal.mape() < 0.15
    # a prompt mostly in the replica's prefix cache computes only the rest
    assert p.predict(LoadView(), LoadView(), 100, cached_tokens=96).cached_tokens == 96
    off = Predictor(AdmissionConfig(calibrate=False, prefill_tokens_per_s=1000.0,
                                    transfer_ms_per_token=0.0, overhead_ms=0.0))
    for _ in range(20):
        off.observe_outcome(off.predict(LoadView(), LoadView(), 100), 300.0, None)
    assert off.predict(LoadView(), LoadView(), 100).ttft_ms == pytest.approx(100.0)


def test_decode_step_fit_by_batch_clips_stalls():
    p = Predictor(AdmissionConfig(decode_step_ms=10.0))
    for b in (1, 4, 8) * 30:
        p.observe_decode_gap(50.0 + 10.0 * b, b)  # CPU-like: steps grow fast with the batch
    assert p.tpot_ms(LoadView(running=0))[0] == pytest.approx(60.0, rel=0.02)
    assert p.tpot_ms(LoadView(running=7))[0] == pytest.approx(130.0, rel=0.02)
    before = p.tpot_ms(LoadView())[1]
    p.observe_decode_gap(5000.0, 1)  # one stalled gap
    assert p.tpot_ms(LoadView())[1] < 1.2 * before


def test_in_flight_and_queued_tokens_are_not_counted_twice():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    both = p.predict(LoadView(queued_tokens=400, inflight_tokens=500), LoadView(), 100)
    assert both.ttft_ms == pytest.approx(600.0)


def test_early_reject_only_when_late_beyond_the_slack():
    pred = Prediction(ttft_ms=500.0, tpot_ms=10.0, idle_ttft_ms=20.0, idle_tpot_ms=10.0,
                      decode_full=False)
    d = decide(pred, 100, None, 0, 30000, early_reject_slack=0.25)
    assert d.kind == "reject" and "waiting would not help" in d.reason
    assert d.retry_after_s == pytest.approx(0.48)  # the backlog ahead drains in 480 ms
    near = Prediction(120.0, 10.0, 20.0, 10.0, False)  # 20 ms late: within 25 ms of slack
    assert decide(near, 100, None, 0, 30000, early_reject_slack=0.25).kind == "queue"
    assert decide(pred, 100, None, 0, 30000).kind == "queue"  # uncalibrated: queue until deadline
    tpot_late = Prediction(10.0, 50.0, 10.0, 5.0, False)  # TPOT lateness resolves by waiting
    assert decide(tpot_late, 100, 20, 0, 30000, early_reject_slack=0.25).kind == "queue"


def test_early_reject_waits_for_calibration():
    p = Predictor(AdmissionConfig(calibration_min_samples=3))
    assert p.early_reject_slack() is None
    for _ in range(3):
        p.observe_outcome(p.predict(LoadView(), LoadView(), 10), 5.0, None)
    assert p.early_reject_slack() == 0.0  # late at all: rejected (see admission.py)


async def test_queue_orders_by_deadline_within_a_priority_and_expires_behind_the_head():
    q = AdmissionQueue()
    state = {"busy": True}
    order = []

    def fn_for(name, expire_ms=None):
        def fn(waited_ms):
            if expire_ms is not None and waited_ms > expire_ms:
                order.append(name + ":rejected")
                return Decision("reject", "late")
            if state["busy"]:
                return Decision("queue", "busy")
            order.append(name)
            return Decision("admit", "ok")
        return fn

    now = time.monotonic()
    late = asyncio.create_task(q.run(fn_for("late"), 0, poll_s=0.01, deadline=now + 10))
    await asyncio.sleep(0.02)
    soon = asyncio.create_task(q.run(fn_for("soon"), 0, poll_s=0.01, deadline=now + 1))
    expiring = asyncio.create_task(q.run(fn_for("expiring", expire_ms=30), 0, poll_s=0.01,
                                         deadline=now + 5, idle_poll_s=0.02))
    await asyncio.sleep(0.1)
    # not at the head, yet its budget passed: rejected where it stood on its next idle poll
    assert expiring.done() and (await expiring).kind == "reject" and len(q) == 2
    state["busy"] = False
    q.notify()
    await asyncio.wait_for(asyncio.gather(late, soon), 2)
    assert order == ["expiring:rejected", "soon", "late"]


async def test_core_learns_from_outcomes_and_rejects_early_once_calibrated():
    s = await make_stack(admission=AdmissionConfig(calibration_min_samples=4,
                                                   prefill_tokens_per_s=1000.0))
    try:
        core = s.core
        ids = core.tokenizer.encode("abcdefgh")
        for _ in range(6):
            r = GenRequest(core.new_request_id(), ids, SamplingParams(temperature=0.0, max_tokens=4))
            _ = [c async for c in core.generate(r)]
        assert core.predictor.ttft_cal.samples == 6 and core.predictor.tpot_cal.samples == 6
        body = core.metrics.render()[0].decode()
        assert 'splitserve_admission_prediction_ratio_count{what="ttft"} 6.0' in body
        assert 'splitserve_admission_prediction_abs_error_ratio{what="tpot"}' in body
        assert 'splitserve_admission_prediction_correction{term="scale",what="ttft"}' in body
        # a backlog far beyond the SLO: rejected at once, with the drain time as Retry-After
        core.prefill.replicas[0].load.queued_tokens = 1_000_000
        t0 = time.monotonic()
        r = GenRequest(core.new_request_id(), ids, SamplingParams(max_tokens=2), ttft_slo_ms=2000)
        with pytest.raises(GatewayError) as ei:
            _ = [c async for c in core.generate(r)]
        assert time.monotonic() - t0 < 0.5 and len(core.queue) == 0
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting would not help" in ei.value.message and ei.value.retry_after_s > 10
        assert core.prefill.replicas[0].load.inflight_tokens == 0  # nothing left counted
    finally:
        await s.close()


def test_decisions_keep_headroom_for_the_estimates_that_come_out_low():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    c = Calibrator()
    assert c.headroom(0.9) == 1.0  # too few samples
    busy = LoadView(queued_tokens=1000)
    for i in range(40):  # right on average, a quarter of them 1.6 x too low
        pr = p.predict(busy, LoadView(), 100)
        p.observe_outcome(pr, pr.est_ttft_ms * (1.6 if i % 4 == 0 else 0.8), None)
    pr = p.predict(busy, LoadView(), 100)
    assert pr.ttft_ms > pr.est_ttft_ms and pr.ttft_ms == pytest.approx(pr.est_ttft_ms * 1.6)
    assert pr.idle_ttft_ms <= pr.est_ttft_ms  # the idle case (reject at once) gets none
    off = Predictor(AdmissionConfig(headroom_quantile=None))
    for _ in range(20):
        off.observe_outcome(off.predict(LoadView(), LoadView(), 100), 1e4, None)
    pr = off.predict(LoadView(), LoadView(), 100)
    assert pr.ttft_ms == pr.est_ttft_ms


async def test_a_new_request_may_not_slow_a_running_one_past_its_tpot_slo():
    s = await make_stack()
    try:
        core = s.core
        d = core.decode.replicas[0]
        r = GenRequest(core.new_request_id(), core.tokenizer.encode("abc"), SamplingParams())
        assert core._decide(r, 0.0).kind == "admit"  # no SLO anywhere
        d.tpot_slos.append(5.0)  # someone running there needs 5 ms per token; steps take ~20
        dd = core._decide(r, 0.0)
        assert dd.kind == "queue" and "tpot_ms=5" in dd.reason
        d.tpot_slos.clear()
        d.load.min_tpot_ms = 5.0  # another gateway's request there, as decode's Load reports it
        dd = core._decide(r, 0.0)
        assert dd.kind == "queue" and "tpot_ms=5" in dd.reason
        d.load.min_tpot_ms = None
        # a request's own TPOT SLO is held on its decode replica while it runs, then dropped
        r2 = GenRequest(core.new_request_id(), core.tokenizer.encode("abc"),
                        SamplingParams(temperature=0.0, max_tokens=3), tpot_slo_ms=900.0)
        seen = []
        async for _ in core.generate(r2):
            seen.append(list(d.tpot_slos))
        assert [900.0] in seen and d.tpot_slos == []
    finally:
        await s.close()


async def test_idle_replicas_admit_a_probe_whatever_an_old_calibration_says():
    s = await make_stack()
    try:
        core = s.core
        for _ in range(30):  # learned under a load that is gone: everything 4x the model
            core.predictor.ttft_cal.observe(10.0, 10.0, 5000.0)
        ids = core.tokenizer.encode("abc")
        raw_idle = core.predictor.prefill_ms(core.prefill.replicas[0].load, len(ids))[1]
        r = GenRequest(core.new_request_id(), ids, SamplingParams(temperature=0.0, max_tokens=2),
                       ttft_slo_ms=2 * raw_idle)
        assert core._decide(r, 0.0).reason.startswith("idle probe")
        assert len([c async for c in core.generate(r)]) == 2 and core.num_admitted == 0
        tiny = GenRequest(core.new_request_id(), ids, SamplingParams(max_tokens=2),
                          ttft_slo_ms=raw_idle / 5)  # beyond even the uncalibrated model x 4
        with pytest.raises(GatewayError):
            _ = [c async for c in core.generate(tiny)]
        # a stale fit 3x too slow (a stall is over) still lets an idle probe through
        stale = GenRequest(core.new_request_id(), ids, SamplingParams(max_tokens=2),
                           ttft_slo_ms=raw_idle / 3)
        assert core._decide(stale, 0.0).reason.startswith("idle probe")
        core.prefill.replicas[0].load.queued_tokens = 10  # others' work there: no probe
        assert core._decide(r, 0.0).kind == "reject"
    finally:
        await s.close()


async def test_prefill_on_decode_predicts_the_prompts_queued_on_the_decode_replica():
    """--prefill-on-decode always: the prompts ahead are those sent to the decode replica and
    not yet past their first token, counted from the admit decision, not the idle prefill
    replica's queue."""
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0,
                                                   transfer_ms_per_token=0.0, overhead_ms=0.0))
    try:
        core = s.core
        core.prefill_on_decode = "always"
        d = core.decode.replicas[0]
        ids = core.tokenizer.encode("abcdefgh")
        r = GenRequest(core.new_request_id(), ids, SamplingParams(max_tokens=2))
        first = core._decide(r, 0.0)
        assert first.kind == "admit" and first.prediction.ttft_bucket == 0
        # the first token also waits for one decode step (the prompt rides in it)
        step = core.predictor.tpot_ms(d.load)[0]
        assert first.prediction.raw_ttft_ms == pytest.approx(len(ids) + step)
        from gateway.routing import Route
        route = Route()
        await core.admit(r, route)
        assert route.here is d and d.load.inflight_tokens == len(ids)
        assert core.prefill.replicas[0].load.inflight_tokens == 0
        r2 = GenRequest(core.new_request_id(), ids, SamplingParams(max_tokens=2))
        second = core._decide(r2, 0.0).prediction
        # + the prompt ahead (1 ms a token), and the step of a batch one larger
        assert second.raw_ttft_ms == pytest.approx(
            2 * len(ids) + core.predictor.tpot_ms(d.load)[0])
        assert second.ttft_bucket == 1
        route.settle()  # its first token came
        assert d.load.inflight_tokens == 0 and d.load.inflight_requests == 0
    finally:
        await s.close()


def test_a_cold_engines_first_prefills_do_not_set_the_fit():
    # two cold prefills (seconds: graph capture, JIT) among warm ones of ~0.02 ms a token
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=50_000))
    for ms in (4000.0, 3500.0, 11.0, 10.0, 9000.0, 12.0, 10.5, 11.0, 10.0, 11.5):
        p.observe_prefill(512, ms)
    assert p.prefill_fit(512) < 20.0
    _, idle = p.prefill_ms(LoadView(), 512)
    assert idle < 25.0  # an idle replica's estimate stays near the warm prefills
    # a replica that really got slower (every prompt 3x+ the fit) is followed within a few
    for _ in range(12):
        p.observe_prefill(512, 200.0)
    assert p.prefill_fit(512) > 60.0


def test_an_offset_pushed_down_by_an_over_predicting_model_comes_back():
    c = Calibrator(additive=True)
    for _ in range(40):  # a cold fit predicts seconds, requests take 30 ms
        c.observe(2000.0, 2000.0, 30.0, 0)
    assert c.offset < -500.0
    for _ in range(40):  # the fit is warm again: raw 20 ms, observed 30 ms
        c.observe(20.0, c.correct(20.0, 0), 30.0, 0)
    assert abs(c.correct(20.0, 0) - 30.0) < 3.0


def test_offset_predicts_the_common_case_of_a_bimodal_ttft():
    """On a device shared with decode, 60% of idle prompts get their first token at compute +
    5 ms and 40% a decode step later (+50 ms): the offset settles on the common case, so most
    predictions are right, instead of an average that is wrong for every request."""
    import random

    cal, rnd, errs = Calibrator(additive=True), random.Random(1), []
    for i in range(400):
        raw = 20.0
        got = raw + (5.0 if rnd.random() < 0.6 else 50.0)
        est = cal.correct(raw, 0)
        if i >= 100:
            errs.append(abs(est - got) / got)
        cal.observe(raw, est, got, 0)
    errs.sort()
    assert 3.0 <= cal.offset <= 10.0
    assert errs[len(errs) // 2] < 0.15


def test_factor_window_holds_the_median_through_a_run_of_outliers():
    """factor_window: a bucket's factor is the median of its recent log ratios, so a few fast
    outcomes in a row (a queue that drained early) do not drag it as they drag the EWMA."""
    med, ewma = Calibrator(additive=True, factor_window=64), Calibrator(additive=True)
    for cal in (med, ewma):
        for _ in range(60):
            cal.observe(100.0, 100.0, 150.0, 3)
        for _ in range(6):
            cal.observe(100.0, 100.0, 60.0, 3)
    assert med.factor(3) == pytest.approx(1.5, rel=0.01)
    assert ewma.factor(3) < 1.0
    young = Calibrator(additive=True, factor_window=64)
    young.observe(100.0, 100.0, 150.0, 2)  # before MEDIAN_AFTER outcomes: the EWMA's step
    assert 1.0 < young.factor(2) < 1.5
