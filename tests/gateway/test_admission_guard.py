"""The attainment guard (closed loop on admitted requests' SLO misses) and the admission queue's
polling of waiters behind its head."""
import asyncio
import math
import random
import time

import pytest

from engine.sampling_params import SamplingParams
from gateway.admission import AdmissionConfig, Decision, LoadView, Predictor
from gateway.admission_queue import AdmissionQueue
from gateway.calibration import AttainmentGuard
from gateway.types import GenRequest
from tests.gateway.conftest import make_stack


def test_guard_settles_where_the_miss_rate_is_the_target():
    """A system whose miss probability falls as the guard tightens admission: the loop finds
    the factor where misses are 1 - target, from below and after a transient above."""
    rng = random.Random(0)
    g = AttainmentGuard(target=0.95, step=0.05, max_factor=4.0)

    def p_miss(factor):  # 40% misses unguarded, 5% at factor ~1.5, none from 2
        return max(0.0, 0.4 * (1 - math.log(factor) / math.log(2.0))) if factor < 2 else 0.0

    factors, misses = [], []
    for _ in range(6000):
        m = rng.random() < p_miss(g.factor)
        misses.append(m)
        g.observe(60.0 if m else 40.0, 50.0)
        factors.append(g.factor)
    assert 1.3 < sorted(factors[-2000:])[1000] < 1.95
    assert sum(misses[-3000:]) / 3000 == pytest.approx(0.05, abs=0.02)


def test_guard_decays_to_one_when_everything_meets_and_stays_bounded():
    g = AttainmentGuard(target=0.95, step=0.05, max_factor=3.0)
    for _ in range(500):
        g.observe(100.0, 50.0)
    assert g.factor == pytest.approx(3.0)
    for _ in range(3000):
        g.observe(10.0, 50.0)
    assert g.factor == pytest.approx(1.0)
    g.observe(float("nan"), 50.0)  # not a sample
    assert g.samples == 3500 and g.misses == 500
    with pytest.raises(ValueError):
        AttainmentGuard(target=1.0)


def test_guard_scales_loaded_predictions_only():
    cfg = AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0, overhead_ms=0.0,
                          guard=True)
    on, off = Predictor(cfg), Predictor(AdmissionConfig(**{**cfg.__dict__, "guard": False}))
    for p in (on, off):
        for _ in range(200):
            p.observe_slo(900.0, 500.0, 90.0, 50.0)
    assert on.ttft_guard.factor > 1.5 and on.tpot_guard.factor > 1.5
    busy_p, busy_d = LoadView(queued_tokens=300), LoadView(running=16, mean_step_ms=20.0)
    a, b = on.predict(busy_p, busy_d, 100), off.predict(busy_p, busy_d, 100)
    assert a.ttft_ms == pytest.approx(b.ttft_ms * on.ttft_guard.factor)
    assert a.tpot_ms == pytest.approx(b.tpot_ms * on.tpot_guard.factor)
    assert a.est_ttft_ms == b.est_ttft_ms  # the estimate (prediction error) is not the guard's
    # idle: nothing ahead, a batch of one: no guard (a request alone is not turned away)
    i, j = on.predict(LoadView(), LoadView(), 100), off.predict(LoadView(), LoadView(), 100)
    assert (i.ttft_ms, i.tpot_ms, i.idle_ttft_ms) == (j.ttft_ms, j.tpot_ms, j.idle_ttft_ms)


def test_guard_auto_scales_only_for_a_decode_replica_on_a_gpu():
    cfg = AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0, overhead_ms=0.0,
                          guard="auto")
    assert cfg.guard_fed and not AdmissionConfig(guard="off").guard_fed
    p = Predictor(cfg)
    for _ in range(200):
        p.observe_slo(900.0, 500.0, 90.0, 50.0)
    busy_p = LoadView(queued_tokens=300)
    gpu = p.predict(busy_p, LoadView(running=16, mean_step_ms=20.0, device_id="cuda:GPU-1"), 100)
    cpu = p.predict(busy_p, LoadView(running=16, mean_step_ms=20.0, device_id="cpu:host"), 100)
    assert gpu.ttft_ms == pytest.approx(cpu.ttft_ms * p.ttft_guard.factor) and p.ttft_guard.factor > 1.5
    assert gpu.tpot_ms == pytest.approx(cpu.tpot_ms * p.tpot_guard.factor)
    with pytest.raises(ValueError):
        AdmissionConfig(guard="sometimes")


async def test_gateway_feeds_the_guard_from_served_requests():
    """Through the gateway against fake replicas over gRPC: a decode slower than the TPOT SLO
    makes every admitted request miss; the guard counts them and tightens. A TTFT SLO met
    leaves the TTFT guard at 1."""
    s = await make_stack(decode_step_s=0.01, admission=AdmissionConfig(guard=True))
    try:
        core = s.core
        for _ in range(6):
            ids = core.tokenizer.encode("abc")
            r = GenRequest(core.new_request_id(), ids, SamplingParams(temperature=0.0, max_tokens=6),
                           ttft_slo_ms=5000.0, tpot_slo_ms=6.0)
            try:
                [c async for c in core.generate(r)]
            except Exception:  # noqa: BLE001 - later ones may be rejected: the predictor learned
                pass
        pred = core.predictor
        assert pred.tpot_guard.samples >= 1 and pred.tpot_guard.misses == pred.tpot_guard.samples
        assert pred.tpot_guard.factor > 1.0
        assert pred.ttft_guard.samples >= 1 and pred.ttft_guard.misses == 0
        assert pred.ttft_guard.factor == 1.0
    finally:
        await s.close()


async def test_guard_off_is_not_fed():
    s = await make_stack(decode_step_s=0.01, admission=AdmissionConfig(guard="off"))
    try:
        core = s.core
        r = GenRequest(core.new_request_id(), core.tokenizer.encode("abc"),
                       SamplingParams(temperature=0.0, max_tokens=6), ttft_slo_ms=5000.0, tpot_slo_ms=6.0)
        [c async for c in core.generate(r)]
        assert core.predictor.tpot_guard.samples == core.predictor.ttft_guard.samples == 0
    finally:
        await s.close()


async def test_waiters_behind_the_head_poll_rarely():
    """Only the head can be admitted: the others re-decide every idle_poll_s (and at their
    deadline), not every poll_s, so a deep queue costs the event loop little."""
    q = AdmissionQueue()
    calls = {"head": 0, "rest": 0}

    def fn_for(name):
        def fn(waited_ms):
            calls[name] += 1
            return Decision("queue", "busy")
        return fn

    head = asyncio.create_task(q.run(fn_for("head"), 5, poll_s=0.01, idle_poll_s=10.0))
    await asyncio.sleep(0.01)
    rest = [asyncio.create_task(q.run(fn_for("rest"), 0, poll_s=0.01, idle_poll_s=10.0))
            for _ in range(50)]
    late = asyncio.create_task(q.run(lambda w: Decision("reject", "late") if w > 100 else
                                     Decision("queue", "busy"), 0, poll_s=0.01, idle_poll_s=10.0,
                                     deadline=time.monotonic() + 0.15))
    await asyncio.sleep(0.4)
    assert calls["head"] >= 15  # the head polls at poll_s
    assert calls["rest"] == 50  # each decided once on arrival, then waits
    assert late.done() and late.result().kind == "reject"  # woken at its deadline
    for t in [head, *rest]:
        t.cancel()
    await asyncio.gather(head, *rest, return_exceptions=True)
    assert len(q) == 0


def test_a_decode_batch_at_its_sequence_cap_is_full():
    """Admitted past the cap, a request would wait in decode for a slot after its first token
    (its TPOT); admission queues it instead, like a KV cache without free blocks."""
    p = Predictor(AdmissionConfig())
    room = LoadView(running=126, max_num_seqs=128)
    assert not p.predict(LoadView(), room, 100).decode_full
    assert p.predict(LoadView(), room, 100, joining=2).decode_full  # 126 + 2 prefilling + 1
    assert p.predict(LoadView(), LoadView(running=128, max_num_seqs=128), 100).decode_full
    assert not p.predict(LoadView(), LoadView(running=500), 100).decode_full  # cap not reported


async def test_decode_reports_its_sequence_cap_through_load():
    """The decode service's Load carries the engine's max_num_seqs to the gateway's view."""
    from common.convert import load_to_pb
    from gateway.routing import load_view_from_pb

    v = load_view_from_pb(load_to_pb({"running": 3, "max_num_seqs": 64}))
    assert v.max_num_seqs == 64 and v.running == 3
    assert load_view_from_pb(load_to_pb({"running": 3})).max_num_seqs is None
