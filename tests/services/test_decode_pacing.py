"""Decode yielding its device to a prefill that shares it (decode_svc/pacing.py): the pacer's
interval and caps, the engine thread holding steps back while still taking commands, and the
counts the pacer's trigger reads (transfers whose KV has not landed)."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from decode_svc.pacing import StepPacer
from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from kvtransfer import KVLayout, KVReceiver
from tests.tiny_engine import tiny_engine


def test_interval_is_ratio_times_fastest_recent_step_under_the_caps():
    p = StepPacer(6.0, 0.050, lambda: True)
    assert p.interval([]) == 0.0  # no step seen yet: nothing to scale
    assert p.interval([0.010, 0.004, 0.020]) == pytest.approx(0.024)
    assert p.interval([0.020]) == pytest.approx(0.050)  # max gap
    p.add_budget("a", 30.0)
    p.add_budget("b", 80.0)
    assert p.budget_cap_s == pytest.approx(0.015)
    assert p.interval([0.020]) == pytest.approx(0.015)  # half the tightest TPOT budget
    p.drop_budget("a")
    assert p.interval([0.020]) == pytest.approx(0.040)
    p.drop_budget("b")
    p.drop_budget("unknown")
    p.add_budget("c", 0)  # no budget
    assert p.budget_cap_s == math.inf
    assert StepPacer(0.0, 0.05, lambda: True).interval([0.01]) == 0.0


def test_delay_only_while_active_and_after_a_step():
    active = [True]
    p = StepPacer(5.0, 1.0, lambda: active[0])
    assert p.delay(10.0, [0.01]) == 0.0  # no step started yet
    p.stepped(10.0, 0.0)
    assert p.delay(10.02, [0.01]) == pytest.approx(0.03)
    assert p.delay(10.06, [0.01]) == 0.0
    active[0] = False
    assert p.delay(10.02, [0.01]) == 0.0
    p.stepped(10.1, 0.02)
    p.stepped(10.2, 0.0)
    assert p.stats() == {"yield_seconds_total": 0.02, "num_yielded_steps": 1}
    with pytest.raises(ValueError):
        StepPacer(-1, 0.05, lambda: True)
    with pytest.raises(ValueError):
        StepPacer(1, -0.05, lambda: True)


class _FixedPacer(StepPacer):
    """Holds every step GAP_S after the previous one (the step time plays no part)."""

    def interval(self, step_times):
        return self.max_gap_s


async def test_engine_thread_spaces_steps_and_still_takes_commands():
    eng = tiny_engine(max_model_len=128, num_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ae = AsyncEngine(engine=eng)
    await ae.start()
    try:
        want = [t for o in [o async for o in ae.generate("free", [5, 6, 7], params)] for t in o.new_token_ids]
        ae.pacer = pacer = _FixedPacer(1.0, 0.06, lambda: True)
        times, toks = [], []
        async for o in ae.generate("paced", [5, 6, 7], params):
            times.append(time.perf_counter())
            toks += o.new_token_ids
        # commands run while a step is held back: a call answers well before the next step
        slow = ae.generate("held", [9, 10, 11], SamplingParams(max_tokens=50, ignore_eos=True))
        await slow.__anext__()
        t0 = time.perf_counter()
        await ae.call(lambda e: e.kv.num_free_blocks)
        call_s = time.perf_counter() - t0
        await slow.aclose()
    finally:
        await ae.stop()
    assert toks == want  # held back, not changed
    # (the prompt step's output and the first decode step's may come together: overlap)
    gaps = [b - a for a, b in zip(times, times[1:])][1:]
    assert min(gaps) >= 0.05, gaps
    assert call_s < 0.04, call_s
    st = ae.stats()
    assert st["num_yielded_steps"] >= len(gaps) and st["yield_seconds_total"] > 0.2


def _receiver():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="fp32", block_size=4)

    class Sink:
        async def write_layer(self, *a): ...

        async def write_scales(self, *a): ...

        async def release(self, *a): ...

    return KVReceiver(Sink(), lay)


async def test_receiver_counts_transfers_whose_kv_has_not_landed():
    rx = _receiver()
    rx.expect("t1", "r1", 1, 4)
    rx.expect("t2", "r2", 1, 4)
    rx.expect("t3", "r3", 1, 4)
    assert rx.num_awaiting == 3
    rx.on_layer_landed("t1", 0, (2, 1, 4, 1, 4), "fp32", None, None)
    await rx.on_commit("t1")
    assert rx.num_awaiting == 2
    rx.fail("t1", "no Decode came")  # DONE -> FAILED: it had landed already
    rx.fail("t2", "prefill died")
    rx.fail("t2", "again")
    assert rx.num_awaiting == 1
    await rx.close()
    assert rx.num_awaiting == 0
    await asyncio.sleep(0)
