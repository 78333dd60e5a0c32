"""Admission controller alone: predictions, decisions, priority queue."""
import asyncio

import pytest

from gateway.admission import AdmissionConfig, Decision, LoadView, Prediction, Predictor, decide
from gateway.admission_queue import AdmissionQueue


def pred(ttft, idle_ttft, tpot=10.0, idle_tpot=10.0, full=False):
    return Prediction(ttft, tpot, idle_ttft, idle_tpot, full)


def test_prediction_scales_with_queued_tokens_and_rate():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    idle = p.predict(LoadView(), LoadView(), 100)
    busy = p.predict(LoadView(queued_tokens=900), LoadView(), 100)
    assert idle.ttft_ms == pytest.approx(100.0)  # 100 tokens at 1000 tok/s
    assert busy.ttft_ms == pytest.approx(1000.0)
    assert busy.idle_ttft_ms == pytest.approx(100.0)
    # the gateway's own in-flight tokens count like queued ones
    assert p.predict(LoadView(inflight_tokens=400), LoadView(), 100).ttft_ms == pytest.approx(500.0)
    # a replica's reported throughput only raises the rate (low throughput when idle is no signal)
    assert p.predict(LoadView(tokens_per_s=100.0), LoadView(), 100).ttft_ms == pytest.approx(100.0)
    assert p.predict(LoadView(tokens_per_s=10000.0), LoadView(), 100).ttft_ms == pytest.approx(10.0)


def test_observed_prefill_times_move_the_estimate():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    for n in (50, 100, 200, 400) * 10:  # measured: 20 ms fixed + 2 ms per token
        p.observe_prefill(n, prefill_ms=20.0 + 2.0 * n)
    a, b = p.prefill_fit.coef()
    assert a == pytest.approx(20.0, rel=0.03) and b == pytest.approx(2.0, rel=0.03)
    assert p.predict(LoadView(), LoadView(), 100).ttft_ms == pytest.approx(220.0, rel=0.03)
    # queued tokens cost the per-token time, not the fixed part
    assert p.predict(LoadView(queued_tokens=100), LoadView(), 100).ttft_ms == pytest.approx(420.0, rel=0.03)
    p.observe_prefill(100, prefill_ms=0.0)  # nonsense measurements are ignored
    assert p.prefill_fit.coef()[1] == pytest.approx(2.0, rel=0.03)


def test_tpot_grows_with_batch_and_kv_pressure():
    p = Predictor(AdmissionConfig(decode_step_ms=10.0, batch_slowdown=0.1))
    t1, _ = p.tpot_ms(LoadView(running=0))
    t10, _ = p.tpot_ms(LoadView(running=9))
    tfull, _ = p.tpot_ms(LoadView(running=9, kv_usage=0.99))
    assert t1 == pytest.approx(10.0) and t10 == pytest.approx(19.0) and tfull > t10
    # a measured step time at the current batch wins when it is slower than the model
    t_meas, _ = p.tpot_ms(LoadView(running=4, mean_step_ms=50.0))
    assert t_meas == pytest.approx(55.0)
    assert p.predict(LoadView(), LoadView(num_free_blocks=0), 10).decode_full


def test_decide_admit_queue_reject():
    # no SLO: admit
    assert decide(pred(5000, 100), None, None, 0, 30000).kind == "admit"
    # within SLO
    assert decide(pred(50, 20), 100, None, 0, 30000).kind == "admit"
    # busy now, an idle replica would make it: queue, with a retry hint
    d = decide(pred(500, 20), 100, None, 0, 30000)
    assert d.kind == "queue" and d.retry_after_s > 0
    # queued past its budget (SLO - idle TTFT): reject
    d = decide(pred(500, 20), 100, None, 85, 30000)
    assert d.kind == "reject" and "ttft_ms=100" in d.reason
    # impossible even when idle: reject right away, message says predicted vs requested
    d = decide(pred(500, 200), 100, None, 0, 30000)
    assert d.kind == "reject" and "200.0 ms" in d.reason and "ttft_ms=100" in d.reason
    # TPOT SLO
    assert decide(pred(10, 10, tpot=50, idle_tpot=5), None, 20, 0, 30000).kind == "queue"
    assert decide(pred(10, 10, tpot=50, idle_tpot=30), None, 20, 0, 30000).kind == "reject"


def test_decide_decode_full_queues_then_rejects():
    assert decide(pred(10, 10, full=True), None, None, 0, 1000).kind == "queue"
    d = decide(pred(10, 10, full=True), None, None, 1500, 1000)
    assert d.kind == "reject" and "decode full" in d.reason


async def test_queue_admits_when_load_drops_and_respects_priority():
    q = AdmissionQueue()
    load = {"busy": True}
    order = []

    def fn_for(name):
        def fn(waited_ms):
            if load["busy"]:
                return Decision("queue", "busy")
            order.append(name)
            return Decision("admit", "ok")
        return fn

    low = asyncio.create_task(q.run(fn_for("low"), priority=0, poll_s=0.01))
    await asyncio.sleep(0.02)
    high = asyncio.create_task(q.run(fn_for("high"), priority=5, poll_s=0.01))
    await asyncio.sleep(0.05)
    assert len(q) == 2 and not low.done()
    load["busy"] = False
    q.notify()
    await asyncio.wait_for(asyncio.gather(low, high), 2)
    assert order == ["high", "low"]  # the later but more important request went first
    assert len(q) == 0


async def test_queue_times_out_into_reject():
    q = AdmissionQueue()

    def fn(waited_ms):
        return Decision("reject", "late") if waited_ms > 50 else Decision("queue", "busy")

    d = await asyncio.wait_for(q.run(fn, 0, poll_s=0.01), 2)
    assert d.kind == "reject" and len(q) == 0


def test_a_cold_engine_first_prefill_cannot_fix_the_slope():
    """Two samples fix a line: a cold engine's multi-second first prompt must not become a
    slope that rejects every later request (which would then bring no samples to undo it)."""
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0,
                                  overhead_ms=0.0))
    p.observe_prefill(200, prefill_ms=8000.0)  # cold
    p.observe_prefill(100, prefill_ms=100.0)
    assert p.prefill_ms(LoadView(), 300)[1] < 2000.0
    for _ in range(6):  # a replica genuinely 5x slower than the prior is still learned
        for n in (100, 300):
            p.observe_prefill(n, prefill_ms=5.0 * n)
    assert p.prefill_ms(LoadView(), 200)[1] == pytest.approx(1000.0, rel=0.15)


def test_handoff_cost_is_fitted_in_the_tokens_it_moves():
    """A prompt mostly in the prefix cache moves few tokens' KV: its handoff's fixed cost (a few
    ms) is no per-token rate to multiply by a long prompt's full length."""
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1e5, overhead_ms=0.0))
    for i in range(30):
        new = 6 + (i % 5) * 4  # cached prompts: 6-22 new tokens, handoff ~3 ms
        p.observe_prefill(new, prefill_ms=5.0, transfer_ms=3.0 + 0.001 * new)
    raw, idle = p.prefill_ms(LoadView(), 736, cached_tokens=720)
    assert idle < 12.0
    raw, idle = p.prefill_ms(LoadView(), 736)  # uncached: the fit's own slope, not 3 ms / 6 tokens
    assert idle < 20.0


def test_decode_step_fit_stays_finite_under_coalesced_gaps():
    """Coalesced token chunks give gaps of microseconds beside real steps of tens of ms at
    varied batch sizes: the step fit and every TPOT prediction stay finite and >= 0 (the clip
    once followed a fit gone negative down until the sums overflowed and TPOT read NaN)."""
    import math
    import random

    p = Predictor(AdmissionConfig())
    rnd = random.Random(0)
    for _ in range(30000):
        b = rnd.choice([1, 2, 5, 64, 128, 256, 300])
        p.observe_decode_gap(rnd.choice([1e-9, 1e-3, 0.01, 5.0, 25.0, 40.0, 400.0]), b)
        t, base = p.tpot_ms(LoadView(running=b))
        assert math.isfinite(t) and t >= 0 and math.isfinite(base) and base >= 0
    a, b = p.step_fit.coef()
    assert a >= 0 and b >= 0


def test_slo_attainment_flag_sets_the_headroom_quantile():
    import argparse

    from gateway.config import add_args, config_from_args

    p = argparse.ArgumentParser()
    add_args(p)
    base = ["--port", "0", "--http-port", "0", "--insecure-internal"]
    assert config_from_args(p.parse_args(base)).admission.headroom_quantile == 0.95
    cfg = config_from_args(p.parse_args([*base, "--slo-attainment", "0.9"]))
    assert cfg.admission.headroom_quantile == 0.9
    with pytest.raises(ValueError, match="slo attainment"):
        config_from_args(p.parse_args([*base, "--slo-attainment", "1.5"]))


def test_prompts_prefilled_on_decode_learn_their_own_rate():
    """--prefill-on-decode auto on one GPU sends every prompt there: no Prefill call ever
    times the prefill fit, so the here fit learns from those prompts' own first tokens (the H100
    run predicted 200-450 ms for 60-140 ms TTFTs off the 2000 tokens/s prior)."""
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=2000.0, overhead_ms=0.0))
    step = p.tpot_ms(LoadView())[0]
    for i in range(30):
        n = 50 + 40 * (i % 8)
        p.observe_prefill_here(n, step + 20.0 + 0.05 * n, step)
    raw, idle = p.prefill_ms(LoadView(), 300, here=True)
    assert abs(idle - (20.0 + 0.05 * 300)) < 3.0
    pred = p.predict(LoadView(), LoadView(), 300, here=True)
    assert abs(pred.raw_ttft_ms - (step + 35.0)) < 3.0
    # the split path keeps its prior: nothing observed it
    assert p.prefill_ms(LoadView(), 300)[1] > 100.0
