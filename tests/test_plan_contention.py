"""planner/simulate.py's device sharing (replicas of one device slow each other only while both
are mid-step, by the calibration's contention stretch) and padded decode attention, and
bench/plan_validate.py's contention read from two engine_costs results."""
from __future__ import annotations

import json

import pytest

from bench import plan_validate
from planner.calibration import Calibration
from planner.simulate import Cluster, SimRequest, simulate, step_cost


def _cal(**kw) -> Calibration:
    # prefill 100 ms whatever the prompt, decode steps 10 ms whatever the batch
    return Calibration((100.0, 0.0, 0.0), (10.0, 0.0, 0.0), **kw)


def _pair(a_out: int, cal: Calibration, devices: int | None) -> tuple[SimRequest, SimRequest]:
    """A prefills alone (0-100 ms) and then decodes; B arrives at 100 ms, as A's decode starts."""
    a, b = simulate([SimRequest(0, 0.0, 10, a_out), SimRequest(1, 100.0, 10, 2)], cal,
                    Cluster(1, 1, devices=devices))
    return a, b


def test_own_devices_do_not_slow_each_other():
    a, b = _pair(50, _cal(contention=2.0), None)
    assert a.ttft_ms == pytest.approx(100) and b.ttft_ms == pytest.approx(100)
    assert a.tpot_ms == pytest.approx(10)


def test_one_device_stretches_both_while_both_are_mid_step():
    """Strict time-slicing (x2): B's prefill overlaps A's decode throughout, so it takes 200 ms,
    and A's steps take 20 ms while it runs."""
    a, b = _pair(50, _cal(contention=2.0), 1)
    assert b.ttft_ms == pytest.approx(200)
    # A's 49 steps: 10 of them (100 ms .. 300 ms) at 20 ms, the rest at 10
    assert a.tpot_ms == pytest.approx((10 * 20 + 39 * 10) / 49)
    a1, b1 = _pair(50, _cal(contention=1.0), 1)
    assert b1.ttft_ms == pytest.approx(100) and a1.tpot_ms == pytest.approx(10)


def test_a_step_speeds_back_up_when_the_other_one_ends():
    """A decodes 2 steps (100-120, 120-140 at x2); B's prefill does 20 ms of its 100 meanwhile,
    then its last 80 alone: first token at 220 ms."""
    a, b = _pair(3, _cal(contention=2.0), 1)
    assert a.end_ms == pytest.approx(140)
    assert b.ttft_ms == pytest.approx(120)


def test_stretch_grows_with_busy_replicas_and_never_speeds_up():
    cal = _cal(contention=1.3)
    assert [cal.stretch(k) for k in (0, 1, 2, 3)] == pytest.approx([1.0, 1.0, 1.3, 1.6])
    with pytest.raises(ValueError, match="contention"):
        _cal(contention=0.9)
    with pytest.raises(ValueError, match="devices"):
        Cluster(1, 1, devices=0)


def test_padded_attention_pays_the_longest_context():
    cal = Calibration((0.0, 0.0, 0.0), (10.0, 1.0, 0.01), padded_attention=True)
    # 4 rows, contexts summing to 400, longest 250: every row pays for 250
    assert step_cost(cal, [], 4, 400.0, 250.0) == pytest.approx(10 + 4 + 0.01 * 4 * 250)
    flat = Calibration((0.0, 0.0, 0.0), (10.0, 1.0, 0.01))
    assert step_cost(flat, [], 4, 400.0, 250.0) == pytest.approx(10 + 4 + 0.01 * 400)
    # in the simulator: a short request decoding beside a long one steps slower when padded
    reqs = lambda: [SimRequest(0, 0.0, 1000, 20), SimRequest(1, 0.0, 10, 20)]  # noqa: E731
    short_padded = simulate(reqs(), cal, Cluster(0, 1))[1].tpot_ms
    short_flat = simulate(reqs(), flat, Cluster(0, 1))[1].tpot_ms
    assert short_padded == pytest.approx(short_flat + 0.01 * (1000 - 10), rel=0.02)


def _costs(path, device, rows):
    path.write_text(json.dumps({"benchmark": "engine_costs", "config": {"device": device},
                                "results": {"rows": [{"shape": "s", "case": c, "eager_ms": ms}
                                                     for c, ms in rows.items()]}}))
    return str(path)


def test_contention_is_the_median_ratio_of_shared_cases(tmp_path):
    alone = _costs(tmp_path / "a.json", "cuda", {"prefill 8": 10.0, "decode b=1 ctx=8": 4.0,
                                                  "decode b=2 ctx=8": 5.0})
    busy = _costs(tmp_path / "b.json", "cuda", {"prefill 8": 18.0, "decode b=1 ctx=8": 6.0,
                                                 "decode b=2 ctx=8": 9.0, "prefill 99": 1.0})
    assert plan_validate.contention_from(alone, busy, "s") == pytest.approx(1.8)
    assert not plan_validate.is_cpu(alone)
    with pytest.raises(ValueError, match="no case in common"):
        plan_validate.contention_from(alone, _costs(tmp_path / "c.json", "cuda", {"x": 1.0}), "s")


def test_decode_keeps_its_rate_when_only_prompt_steps_stretch():
    a, b = _pair(50, _cal(contention=2.0, contention_decode=False), 1)
    assert b.ttft_ms == pytest.approx(200) and a.tpot_ms == pytest.approx(10)


def _closed(conc: int, made: Calibration, n: int) -> dict:
    from planner.replay import summarize, trace_requests

    out = simulate(trace_requests(n, 1.0, "lognormal:64,0.6", "fixed:16"), made, Cluster(0, 1), concurrency=conc)
    return {"benchmark": "serve", "config": {"input_len": "lognormal:64,0.6", "output_len": "fixed:16", "seed": 0},
            "results": {"runs": [{"label": "A", "concurrency": conc, "summary": summarize(out),
                                  "requests": [{}] * n}]}}


def test_row_cost_growth_fits_back_from_two_loads():
    """Runs made with a per-row cost of 2 ms + 0.05 ms x batch: the c=8 and c=32 fits recover it."""
    cal = Calibration((30.0, 0.3, 0.0), (20.0, 1.5, 0.005))
    made = Calibration(cal.prefill, (20.0, 3.5, 0.005), row_growth=0.05)
    lo, hi = _closed(8, made, 48), _closed(32, made, 96)
    row, growth = 0.0, 0.0
    for _ in range(4):
        growth = plan_validate.fit_rows(hi, Calibration(cal.prefill, (20.0, 1.5 + row, 0.005)),
                                        Cluster(0, 1), growth=True)
        row = plan_validate.fit_rows(lo, Calibration(cal.prefill, cal.decode, row_growth=growth), Cluster(0, 1))
    assert growth == pytest.approx(0.05, rel=0.15) and row == pytest.approx(2.0, abs=0.3)


def test_padded_attention_follows_the_calibrations_decode_attention(tmp_path):
    def costs(name, config):
        p = tmp_path / name
        p.write_text(json.dumps({"benchmark": "engine_costs", "config": config, "results": {"rows": []}}))
        return str(p)

    assert plan_validate.padded_auto(costs("old.json", {"device": "cpu"}))  # not recorded: padded
    assert plan_validate.padded_auto(costs("t.json", {"device": "cpu", "cpu_decode_attention": "torch"}))
    assert not plan_validate.padded_auto(costs("n.json", {"device": "cpu", "cpu_decode_attention": "native"}))
    assert not plan_validate.padded_auto(costs("g.json", {"device": "cuda"}))
