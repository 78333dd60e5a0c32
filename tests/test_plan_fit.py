"""The planner's engine step curve (Calibration.bend: the decode step through the engine's
measured batches) and the request overhead per decode row in flight (Calibration.ttft_row_ms),
each fitted back from synthetic data made with a known truth (planner/calibration.py,
planner/fit.py, planner/simulate.py)."""
from __future__ import annotations

import dataclasses

import pytest

from bench import plan_validate
from planner.calibration import Calibration, calibrate, fit_decode
from planner.fit import fit_idle, fit_ttft_rows
from planner.replay import summarize, trace_requests
from planner.simulate import Cluster, SimRequest, simulate, step_cost

PREFILL = [(32, 2.0), (128, 2.5), (512, 4.0), (2048, 10.0)]


def _engine(b: int, ctx: int) -> float:
    """A step that is not linear in its batch: batches 5-8 run a slower kernel (+1 ms)."""
    return 1.3 + 0.01 * b + 1e-5 * b * ctx + (1.0 if 4 < b <= 8 else 0.0)


def _decode_points() -> list[tuple[int, int, float]]:
    return [(b, c, _engine(b, c)) for b in (1, 8, 32, 64, 128) for c in (256, 768)]


def test_curve_passes_through_the_measured_batches_and_the_line_does_not():
    pts = _decode_points()
    cal = calibrate(PREFILL, pts)
    for b, c, ms in pts:
        assert cal.step_ms(b, c) == pytest.approx(ms, abs=1e-6)
    line = calibrate(PREFILL, pts, curve=False)
    assert line.bend == () and line.decode == fit_decode(pts)
    assert abs(line.step_ms(8, 256) - _engine(8, 256)) > 0.5  # what the line alone gets wrong
    # between knots: linear in batch; beyond the last: the line plus the last residual
    mid = (cal.bend_ms(8) + cal.bend_ms(32)) / 2
    assert cal.bend_ms(20) == pytest.approx(mid)
    assert cal.bend_ms(256) == pytest.approx(cal.bend_ms(128))
    assert cal.bend_ms(0.5) == pytest.approx(cal.bend_ms(1))


def test_one_batch_has_no_curve_and_bad_values_are_refused():
    assert calibrate(PREFILL, [(8, 256, 3.0), (8, 768, 3.5)]).bend == ()
    with pytest.raises(ValueError, match="ttft_row_ms"):
        Calibration((1.0, 0.0, 0.0), (1.0, 0.0, 0.0), ttft_row_ms=-1.0)


def test_the_simulated_step_runs_on_the_curve():
    cal = calibrate(PREFILL, _decode_points())
    assert step_cost(cal, [], 8, 8 * 256.0) == pytest.approx(_engine(8, 256), abs=1e-6)
    # eight requests decoding side by side at context ~256 (the first one a step ahead): their
    # steps are the slow batch-8 ones, where the line alone would put them 0.66 ms lower
    reqs = [SimRequest(i, 0.0, 250, 12) for i in range(8)]
    out = simulate(reqs, dataclasses.replace(cal, prefill=(0.0, 0.0, 0.0)), Cluster(0, 1))
    tpot = sorted(r.tpot_ms for r in out)
    assert tpot[4] == pytest.approx(_engine(8, 256), abs=0.05)
    line = calibrate(PREFILL, _decode_points(), curve=False)
    assert tpot[4] > line.step_ms(8, 256) + 0.5


def test_idle_fit_finds_no_step_overhead_where_the_curve_explains_batch_one():
    """An idle run whose TPOT is the engine's batch-1 step: with the curve the step overhead is
    ~0; with the line alone (whose intercept the batch-8 kernel lifts) it would be hidden."""
    cal = calibrate(PREFILL, _decode_points())
    reqs = trace_requests(12, 1.0, "lognormal:192,0.8", "fixed:64")
    rows = [{"status": "ok", "ttft_ms": 9.0 + cal.prefill_ms(r.input_len),
             "tpot_ms": 0.4 + _engine(1, r.input_len + 32)} for r in reqs]
    doc = {"config": {"input_len": "lognormal:192,0.8", "output_len": "fixed:64", "seed": 0},
           "results": {"runs": [{"concurrency": 1, "summary": {}, "requests": rows}]}}
    over, step = fit_idle(doc, cal)
    assert over == pytest.approx(9.0) and step == pytest.approx(0.4, abs=0.01)


def _loaded(made: Calibration, cluster: Cluster, conc: int, n: int) -> dict:
    """A closed-loop bench.serve document whose per-request rows the simulator made with `made`."""
    spec = ("lognormal:192,0.8", "lognormal:64,0.5")
    out = simulate(trace_requests(n, 1.0, *spec), made, cluster, concurrency=conc)
    rows = [{"idx": r.idx, "status": r.status, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms} for r in out]
    return {"config": {"input_len": spec[0], "output_len": spec[1], "seed": 0},
            "results": {"runs": [{"concurrency": conc, "summary": summarize(out), "requests": rows}]}}


def test_request_overhead_grows_with_the_decode_rows_in_flight():
    cal = Calibration((5.0, 0.0, 0.0), (2.0, 0.0, 0.0), ttft_overhead_ms=10.0)
    # request 1 is sent while request 0 decodes (one row in flight): 3 ms more on its way in
    reqs = [SimRequest(0, 0.0, 10, 100), SimRequest(1, 50.0, 10, 2)]
    a, b = simulate(reqs, dataclasses.replace(cal, ttft_row_ms=3.0), Cluster(1, 1))
    assert a.ttft_ms == pytest.approx(15.0) and b.ttft_ms == pytest.approx(18.0)
    a0, b0 = simulate([SimRequest(0, 0.0, 10, 100), SimRequest(1, 50.0, 10, 2)], cal, Cluster(1, 1))
    assert b0.ttft_ms == pytest.approx(15.0)


@pytest.mark.parametrize("truth", [0.0, 0.4, 1.5])
def test_ttft_row_fit_recovers_the_per_row_overhead(truth):
    cal = Calibration((3.0, 0.01, 0.0), (4.0, 0.05, 1e-5), ttft_overhead_ms=10.0, contention=2.0)
    cluster = Cluster(1, 1, devices=1)
    doc = _loaded(dataclasses.replace(cal, ttft_row_ms=truth), cluster, 16, 96)
    assert fit_ttft_rows(doc, cal, cluster) == pytest.approx(truth, abs=0.05)


def test_plan_validate_refuses_two_fits_of_one_figure(tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text("{}")
    argv = [str(f), "--calibration", str(f), "--loaded", str(f), "--devices", "1", "--no-write"]
    assert plan_validate.main([*argv, "--fit-ttft-rows", "--fit-contention"]) == 2
    assert "--fit-ttft-rows" in capsys.readouterr().err
