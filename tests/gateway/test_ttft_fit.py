"""The TTFT fit (gateway/ttft_fit.py) and the prefill steps it reads (gateway/prefill_clock.py):
convergence on synthetic steps, outliers, cold start, the Predictor's use of it."""
import random

import numpy as np
import pytest

from gateway.admission import AdmissionConfig, LoadView, Predictor
from gateway.prefill_clock import STALE_S, Ahead, PrefillClock
from gateway.ttft_fit import MIN_SAMPLES, TtftFit, design
from gateway.types import prediction_timings
from protos import generate_pb2

TRUE = np.array([3.0, 6.0, 1.0, 0.05, 0.045, 0.045])  # c4 = r: 0.045 ms a prompt token


def _state(rnd: random.Random) -> tuple:
    busy = rnd.random() < 0.85
    running = rnd.choice((64, 300, 900, 1800)) if busy else 0
    queued = rnd.choice((0, 200, 800, 2500)) if busy else 0
    elapsed = rnd.uniform(0, 60) if busy else 0.0
    return (running, queued, elapsed, rnd.uniform(0, 10), 2048, rnd.choice((30, 120, 400, 1000)))


def _truth(s: tuple) -> float:
    return float(design(np.asarray([s], dtype=float), TRUE[4])[0] @ TRUE)


def _feed(fit: TtftFit, n: int, seed: int = 0, stall: float = 0.0) -> random.Random:
    rnd = random.Random(seed)
    for _ in range(n):
        s = _state(rnd)
        fit.predict(s)  # as the gateway does: a prediction (and a refit) between outcomes
        y = _truth(s) * rnd.uniform(0.97, 1.03)
        u = rnd.random()
        if u < stall:  # both ways: a stall (GC, a cold kernel) and a clock or cache surprise
            y *= rnd.uniform(5, 20) if u < stall / 2 else rnd.uniform(0.05, 0.2)
        fit.add(s, y)
    return rnd


def test_fit_converges_to_known_step_coefficients_from_a_prior_10x_off():
    fit = TtftFit(per_token_prior_ms=0.5)
    _feed(fit, 400)
    c = fit.coef()
    assert fit.per_token == pytest.approx(0.045, rel=0.05)
    assert c[2] == pytest.approx(1.0, rel=0.1) and c[3] == pytest.approx(0.05, rel=0.1)
    rnd = random.Random(7)
    for _ in range(50):
        s = _state(rnd)
        assert fit.predict(s) == pytest.approx(_truth(s), rel=0.05)


def test_a_minority_of_stalls_moves_the_fit_a_bounded_amount():
    fit = TtftFit(per_token_prior_ms=0.05)
    _feed(fit, 400, seed=1, stall=0.1)  # 10% of outcomes 5-20x slow or fast
    assert fit.per_token == pytest.approx(0.045, rel=0.15)
    rnd = random.Random(3)
    errs = [abs(fit.predict(s) / _truth(s) - 1) for s in (_state(rnd) for _ in range(100))]
    assert sorted(errs)[50] < 0.1


def test_cold_fit_predicts_nothing_and_rejects_bad_outcomes():
    fit = TtftFit()
    rnd = _feed(fit, MIN_SAMPLES - 1)
    s = _state(rnd)
    assert fit.predict(s) is None and fit.coef() is None and fit.per_token == fit.prior
    fit.add(s, float("inf"))
    fit.add(s, 0.0)
    fit.add((1.0, 2.0), 5.0)
    assert fit.samples == MIN_SAMPLES - 1
    fit.add(s, _truth(s))
    assert fit.predict(s) is not None


def test_clock_splits_running_and_queued_prompts_by_the_last_finish():
    c = PrefillClock()
    assert c.ahead(0.0) == Ahead(0, 0, 0.0, 0.0, None) and not c.ahead(0.0).busy
    a = c.admit(300, 1.000)      # idle replica: a step starts with it
    b = c.admit(200, 1.010)
    got = c.ahead(1.020, budget=2048)
    assert (got.running_tokens, got.queued_tokens) == (300, 200)
    assert got.elapsed_ms == pytest.approx(20.0) and got.tokens_per_ms == pytest.approx(1.0)
    c.done(a, 1.030)             # a step ended: the next began with what was waiting
    d = c.admit(100, 1.031)
    got = c.ahead(1.040, budget=2048)
    assert (got.running_tokens, got.queued_tokens) == (200, 100)
    assert got.elapsed_ms == pytest.approx(10.0)
    assert c.ahead(1.040, budget=150).running_tokens == 150  # a step takes at most the budget
    assert c.ahead(1.040, budget=150).queued_tokens == 150
    assert c.ahead(1.040, polled_queued=1000).queued_tokens == 100 + 700  # others' prompts
    c.done(b, 1.050, finished=False)  # a cancel ends no step
    assert c.last_done == pytest.approx(1.030)
    c.done(d, 1.060)
    assert len(c) == 0 and c.ahead(1.7).tokens_per_ms == 0.0  # the rate window passed
    c.admit(10, 2.0)
    assert len(c) == 1 and c.ahead(2.0 + STALE_S + 1).running_tokens == 0  # a leak is dropped


def _outcomes(p: Predictor, n: int) -> None:
    rnd = random.Random(5)
    for _ in range(n):
        s = _state(rnd)
        a = Ahead(*s[:4], budget=2048)
        pr = p.predict(LoadView(queued_tokens=s[0] + s[1]), LoadView(), s[5], ahead=a)
        p.observe_outcome(pr, _truth(s), None)


def test_predictor_uses_the_fit_once_warm_and_the_queue_model_before():
    cfg = dict(prefill_tokens_per_s=20000.0, transfer_ms_per_token=0.0, overhead_ms=0.0)
    p = Predictor(AdmissionConfig(**cfg))
    a, s = Ahead(900, 800, 10.0, 4.0, 2048), (900, 800, 10.0, 4.0, 2048, 400)
    cold = p.predict(LoadView(queued_tokens=1700), LoadView(), 400, ahead=a)
    assert cold.fit_ttft_ms is None and cold.ttft_sample == s
    assert cold.est_ttft_ms == pytest.approx(p.ttft_cal.correct(cold.raw_ttft_ms, cold.ttft_bucket))
    _outcomes(p, 300)
    warm = p.predict(LoadView(queued_tokens=1700), LoadView(), 400, ahead=a)
    assert warm.fit_ttft_ms == pytest.approx(_truth(s), rel=0.05)
    assert warm.est_ttft_ms == pytest.approx(warm.fit_ttft_ms)
    # the queue model alone when asked (the fit still learns, to be logged)
    q = Predictor(AdmissionConfig(ttft_model="queue", **cfg))
    _outcomes(q, 300)
    pr = q.predict(LoadView(queued_tokens=1700), LoadView(), 400, ahead=a)
    assert pr.fit_ttft_ms is not None
    assert pr.est_ttft_ms == pytest.approx(q.ttft_cal.correct(pr.raw_ttft_ms, pr.ttft_bucket))
    # prefilled on decode: no prefill steps to read
    assert p.predict(LoadView(), LoadView(), 400, here=True, ahead=a).ttft_sample is None
    with pytest.raises(ValueError):
        AdmissionConfig(ttft_model="magic")


def test_timings_carry_the_steps_ahead_for_the_replay():
    p = Predictor(AdmissionConfig())
    pr = p.predict(LoadView(), LoadView(), 100, cached_tokens=16, ahead=Ahead(300, 50, 12.5, 2.0))
    t = prediction_timings(pr, 0.003)
    assert t["ahead_running_tokens"] == 300 and t["ahead_queued_tokens"] == 50
    assert t["ahead_tokens_per_s"] == pytest.approx(2000.0) and t["predicted_fit_ttft_ms"] == 0.0
    assert t["predicted_cached_tokens"] == 16 and t["predicted_decode_batch"] == 1
    msg = generate_pb2.Timings(**t)  # the gRPC front copies them as they are
    assert msg.ahead_elapsed_ms == pytest.approx(12.5)
