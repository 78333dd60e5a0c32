"""planner/simulate.py: closed forms (M/D/1 prefill wait, an idle request's TTFT and TPOT,
chunked prefill, constant-cost continuous batching), conservation of requests, determinism from
the trace seed, admission, and bench/plan_validate.py on a bench.serve-shaped result."""
from __future__ import annotations

import json
import math

import pytest

from bench import plan_validate
from bench.serve_trace import TraceSpec, arrival_times, build_trace
from planner.calibration import Calibration
from planner.replay import bench_points, lognormal_spec, summarize, trace_requests
from planner.simulate import Cluster, SimRequest, simulate, step_cost
from splitserve_cli.plan import RESULTS


def _cal(prefill=(0.0, 0.5, 0.0), decode=(10.0, 0.0, 0.0), **kw) -> Calibration:
    return Calibration(prefill, decode, **kw)


def test_one_prefill_replica_is_md1():
    """Fixed 100-token prompts, one per step (budget 100), 50 ms each, Poisson at 12/s:
    Pollaczek-Khinchine mean wait = rate S^2 / (2 (1 - rho))."""
    reqs = trace_requests(20000, 12.0, "fixed:100", "fixed:1", seed=3)
    out = simulate(reqs, _cal(), Cluster(1, 1, max_batched_tokens=100))
    lam, s = 12 / 1e3, 50.0
    want = lam * s * s / (2 * (1 - lam * s)) + s
    mean = sum(r.ttft_ms for r in out) / len(out)
    assert mean == pytest.approx(want, rel=0.05)


def test_idle_request_ttft_and_tpot_are_the_cost_model():
    cal = _cal(prefill=(20.0, 0.5, 0.001), decode=(10.0, 1.0, 0.01), ttft_overhead_ms=7.0,
               kv_bytes_per_token=1000, kv_gbps=1.0)  # 1000 B/token at 1 GB/s: 1 us/token
    [r] = simulate([SimRequest(0, 0.0, 100, 11)], cal, Cluster(0, 1))
    assert r.ttft_ms == pytest.approx(7 + cal.prefill_ms(100))
    # colocated: 10 decode steps of one row whose context grows 101 .. 110
    steps = [10 + 1 + 0.01 * c for c in range(101, 111)]
    assert r.tpot_ms == pytest.approx(sum(steps) / 10)
    [s] = simulate([SimRequest(0, 0.0, 100, 11)], cal, Cluster(1, 1, handoff_fixed_ms=3.0))
    assert s.ttft_ms == pytest.approx(r.ttft_ms)
    assert s.tpot_ms == pytest.approx((sum(steps) + 3.0 + 0.1) / 10)  # the handoff delays token 2


def test_chunked_prefill_steps_and_mixed_step_cost():
    cal = _cal(prefill=(5.0, 0.1, 0.001))
    [r] = simulate([SimRequest(0, 0.0, 600, 1)], cal, Cluster(0, 1, max_batched_tokens=256))
    chunks = [(256, 0), (256, 256), (88, 512)]
    assert r.ttft_ms == pytest.approx(sum(step_cost(cal, [c], 0, 0) for c in chunks))
    # a mixed step pays the fixed cost once
    assert step_cost(cal, [(10, 0)], 4, 400) == pytest.approx(5 + 1 + 0.1 + 10 - 5)


def test_constant_step_decode_batches_without_slowing():
    """Decode step cost independent of the batch: every request's TPOT is one step (plus its
    wait for the next step boundary spread over its tokens)."""
    reqs = trace_requests(400, 20.0, "fixed:10", "fixed:50", seed=1)
    out = simulate(reqs, _cal(prefill=(1.0, 0.0, 0.0)), Cluster(1, 2))
    assert all(10.0 <= r.tpot_ms <= 10.0 + 11.0 / 49 for r in out)


def test_every_request_ends_once_and_runs_are_deterministic():
    cal = _cal(prefill=(30.0, 0.3, 0.0005), decode=(20.0, 1.5, 0.005))
    kw = dict(input_len="lognormal:64,0.6", output_len="lognormal:32,0.5")
    runs = [summarize(simulate(trace_requests(300, 6.0, seed=s, **kw), cal, Cluster(0, 1)), 500, 100)
            for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    out = simulate(trace_requests(300, 6.0, **kw), cal, Cluster(2, 1))
    assert all(r.status == "ok" and r.arrival_ms <= r.first_ms <= r.end_ms for r in out)
    assert len({r.idx for r in out}) == 300


def test_admission_rejects_what_would_be_late():
    cal = _cal()
    reqs = trace_requests(600, 40.0, "fixed:100", "fixed:1")  # 2x one replica's capacity
    late = summarize(simulate(trace_requests(600, 40.0, "fixed:100", "fixed:1"), cal, Cluster(1, 1)), 300)
    adm = summarize(simulate(reqs, cal, Cluster(1, 1, admission=True), ttft_slo_ms=300), 300)
    assert late["rejected"] == 0 and late["ttft_ms_p99"] > 1000
    assert adm["rejected"] > 200 and adm["ttft_ms_p99"] <= 300
    assert adm["goodput_rps"] > late["goodput_rps"]


def test_lognormal_spec_keeps_the_mean():
    kind, args = lognormal_spec(200, 0.8).split(":")
    med, sigma = map(float, args.split(","))
    assert kind == "lognormal" and med * math.exp(sigma ** 2 / 2) == pytest.approx(200, rel=1e-4)
    assert lognormal_spec(128, 0) == "fixed:128"


def _serve_doc(rate: float, n: int) -> dict:
    spec = TraceSpec(num_requests=n, input_len="fixed:16", output_len="fixed:8", seed=0)
    times = arrival_times(n, rate, "poisson", 1.0, 0)
    rows = [{"idx": r.idx, "send_s": t, "status": "ok", "ttft_ms": 90.0, "tpot_ms": 40.0, "tokens": 8}
            for r, t in zip(build_trace(spec), times)]
    summ = {"requests": n, "completed": n, "rejected": 0, "wall_s": times[-1] + 1, "throughput_rps": rate,
            "goodput_rps": rate, "output_tok_s": 8 * rate, "slo_attainment": 1.0,
            "ttft_ms_p50": 90.0, "tpot_ms_p50": 40.0, "ttft_ms_p90": 100.0, "tpot_ms_p90": 45.0,
            "ttft_ms_p99": 120.0, "tpot_ms_p99": 50.0}
    return {"benchmark": "serve", "commit": "x", "date": "d",
            "config": {"input_len": "fixed:16", "output_len": "fixed:8", "seed": 0, "arrival": "poisson",
                       "burstiness": 1.0, "ttft_ms": 1000, "tpot_ms": 100, "prefix_share": 0.0},
            "results": {"runs": [{"label": "A", "rate": rate, "summary": summ, "requests": rows}]}}


def test_bench_points_rebuild_the_trace_sent():
    [p] = bench_points(_serve_doc(2.0, 20))
    assert [(r.input_len, r.output_len) for r in p["requests"]] == [(16, 8)] * 20
    assert [r.arrival_ms / 1e3 for r in p["requests"]] == pytest.approx(arrival_times(20, 2.0))
    with pytest.raises(ValueError, match="bench.serve result"):
        bench_points({"benchmark": "engine_gpu", "config": {}, "results": {"rows": []}})


def test_plan_validate_prints_predicted_vs_measured(tmp_path, capsys):
    costs = [c for c in sorted(RESULTS.glob("engine_costs-*.json"))
             if json.loads(c.read_text())["config"].get("shape") == "smollm2-135m"]
    assert costs, "the committed CPU engine costs (SmolLM2; GPU runs sit beside them)"
    f = tmp_path / "serve.json"
    f.write_text(json.dumps(_serve_doc(2.0, 30)))
    assert plan_validate.main([str(f), "--calibration", str(costs[-1]), "--overhead-ms", "10",
                               "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "P50 TTFT ms" in out and "goodput" in out and "1x colocated" in out
    assert plan_validate.main([str(f), "--calibration", str(f), "--no-write"]) == 2


# ---- `splitserve plan` on the simulator -----------------------------------------------------
PLAN = ["plan", "--rate", "20", "--input-len", "2048", "--output-len", "256", "--ttft-ms", "500",
        "--tpot-ms", "20", "--prefill-points", "128:6,512:14,2048:55,4096:114",
        "--decode-points", "1x1024:4.1,64x1024:7.4,128x1024:10.3,64x4096:13.9,128x4096:23.2",
        "--sim-requests", "600"]


def test_plan_json_carries_the_simulated_search(capsys):
    from splitserve_cli.main import main

    assert main([*PLAN, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    sim = d["simulated"]
    assert sim["shape"] == "2P1D" and sim["best"]["meets"]
    tried = {t["shape"]: t["meets"] for t in sim["tried"]}
    assert tried["1P1D"] is False  # one prefill replica is past its capacity at 20/s
    assert main([*PLAN, "--topology", "colocated", "--json"]) == 0
    assert "colocated" in json.loads(capsys.readouterr().out)["simulated"]["shape"]
    assert main([*PLAN, "--no-sim", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulated"] is None
    assert main([*PLAN, "--sim-requests", "0"]) == 2
    assert "--sim-requests must be >= 1" in capsys.readouterr().err


def test_closed_loop_keeps_concurrency_clients_busy():
    """Closed loop, constant costs: each client's requests run back to back, so with one client
    the run lasts the sum of their times and nothing ever queues."""
    cal = _cal(prefill=(20.0, 0.0, 0.0), decode=(10.0, 0.0, 0.0), ttft_overhead_ms=5.0)
    reqs = trace_requests(10, 1.0, "fixed:8", "fixed:4")
    out = simulate(reqs, cal, Cluster(0, 1), concurrency=1)
    assert all(r.ttft_ms == pytest.approx(25.0) for r in out)
    assert out[-1].end_ms == pytest.approx(10 * (25 + 3 * 10))
    four = simulate(trace_requests(40, 1.0, "fixed:8", "fixed:4"), cal, Cluster(0, 1), concurrency=4)
    assert max(r.end_ms for r in four) < 10 * (25 + 3 * 10) * 4  # batched: faster than serial


def _closed_doc(conc: int, summary: dict, rows: list) -> dict:
    return {"benchmark": "serve", "config": {"input_len": "lognormal:64,0.6", "output_len": "fixed:16", "seed": 0},
            "results": {"runs": [{"label": "A", "concurrency": conc, "summary": summary, "requests": rows}]}}


def test_serving_overheads_fit_back_what_made_the_runs():
    cal = _cal(prefill=(30.0, 0.3, 0.0005), decode=(20.0, 1.5, 0.005))
    reqs = trace_requests(12, 1.0, "lognormal:64,0.6", "fixed:16")
    rows = [{"status": "ok", "ttft_ms": 40 + cal.prefill_ms(r.input_len),
             "tpot_ms": 3 + cal.step_ms(1, r.input_len + 8)} for r in reqs]
    assert plan_validate.fit_idle(_closed_doc(1, {}, rows), cal) == pytest.approx((40.0, 3.0))
    made = Calibration(cal.prefill, (20.0, 1.5 + 2.5, 0.005))
    loaded = simulate(trace_requests(48, 1.0, "lognormal:64,0.6", "fixed:16"), made, Cluster(0, 1), concurrency=8)
    doc = _closed_doc(8, summarize(loaded), [{}] * 48)
    assert plan_validate.fit_rows(doc, cal, Cluster(0, 1)) == pytest.approx(2.5, abs=0.05)


def test_plan_serving_overheads_slow_the_simulated_decode(capsys):
    from splitserve_cli.main import main

    assert main([*PLAN, "--json"]) == 0
    base = json.loads(capsys.readouterr().out)["simulated"]["best"]["figures"]["tpot_ms_p50"]
    assert main([*PLAN, "--json", "--row-overhead-ms", "0.05"]) == 0
    slower = json.loads(capsys.readouterr().out)["simulated"]["best"]["figures"]["tpot_ms_p50"]
    assert slower > base
    assert main([*PLAN, "--row-overhead-ms", "-1"]) == 2
    assert "--row-overhead-ms must be >= 0" in capsys.readouterr().err
