"""The serving path's own costs, fitted from closed-loop bench.serve runs taken apart from the
runs a calibration is checked on (bench/plan_validate.py): each fit bisects one term until the
simulated closed loop of that run reproduces one of its measured figures.

    fit_idle        concurrency 1: request overhead (median TTFT - prefill) and step overhead
                    (median TPOT - the engine's step at batch 1)
    fit_rows        concurrency N: per decode row a step (P50 TPOT); with `growth` the per-row
                    cost's growth with the batch (Calibration.row_growth)
    fit_contention  concurrency N: the stretch of a step while another replica of its device
                    is mid-step (P50 TTFT)
    fit_ttft_rows   concurrency N: request overhead per decode row in flight (the median of
                    the per-request TTFT gaps; Calibration.ttft_row_ms)
    contention_from two engine_costs results (alone, beside busy engines): the measured stretch
"""
from __future__ import annotations

import dataclasses
import json
import statistics

from planner.calibration import Calibration
from planner.replay import summarize, trace_requests
from planner.simulate import Cluster, simulate


def closed_run(doc: dict, want_one: bool) -> tuple[dict, list]:
    """(the concurrency-1 or -N point of a bench.serve result, the SimRequests of its trace)."""
    cfg = doc["config"]
    run = next((r for r in doc["results"]["runs"] if "concurrency" in r and
                (r["concurrency"] == 1) == want_one), None)
    if run is None:
        raise ValueError(f"want a bench.serve result with a --concurrency {'1' if want_one else 'N > 1'} point")
    reqs = trace_requests(len(run["requests"]), 1.0, cfg["input_len"], cfg["output_len"], cfg.get("seed", 0))
    return run, reqs


def fit_idle(doc: dict, cal: Calibration) -> tuple[float, float]:
    """(per-request overhead ms, per-step overhead ms) from a closed-loop concurrency-1 run."""
    run, reqs = closed_run(doc, True)
    pre, step = [], []
    for row, r in zip(run["requests"], reqs):
        if row.get("status") != "ok":
            continue
        pre.append(row["ttft_ms"] - cal.prefill_ms(r.input_len))
        if row.get("tpot_ms") is not None:
            step.append(row["tpot_ms"] - cal.step_ms(1, r.input_len + r.output_len / 2))
    if not pre:
        raise ValueError("--idle: no completed request")
    return max(0.0, statistics.median(pre)), max(0.0, statistics.median(step)) if step else 0.0


def solve_increasing(f, want: float, lo: float, hi: float, iters: int) -> float:
    """x in [lo, hi] with f(x) = want for an f that grows with x (bisection); lo when f(lo)
    already reaches want."""
    if f(lo) >= want:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < want else (lo, mid)
    return (lo + hi) / 2


def _closed_p50(doc: dict, key: str, lo: float, hi: float, iters: int, cal_at) -> float:
    """x in [lo, hi] making the simulated closed loop's P50 `key` the run's (cal_at(x): the
    calibration with x in place)."""
    run, reqs = closed_run(doc, False)
    want, n = run["summary"][key], int(run["concurrency"])

    def sim(x: float) -> float:
        fresh = [dataclasses.replace(r) for r in reqs]
        c, cluster = cal_at(x)
        return summarize(simulate(fresh, c, cluster, concurrency=n))[key]

    return solve_increasing(sim, want, lo, hi, iters)


def fit_rows(doc: dict, cal: Calibration, cluster: Cluster, growth: bool = False) -> float:
    """Per-row step overhead (ms; with `growth` the per-row-per-row one, Calibration.row_growth)
    making the simulated closed loop's P50 TPOT the measured one."""
    d0, d1, d2 = cal.decode

    def at(x: float):
        c = dataclasses.replace(cal, row_growth=x) if growth else dataclasses.replace(cal, decode=(d0, d1 + x, d2))
        return c, cluster

    return _closed_p50(doc, "tpot_ms_p50", 0.0, 1.0 if growth else 50.0, 30, at)


def fit_contention(doc: dict, cal: Calibration, cluster: Cluster) -> float:
    """Contention stretch making the simulated closed loop's P50 TTFT the measured one: the
    replicas of one device slowing each other, the serving processes on its cores included."""
    return _closed_p50(doc, "ttft_ms_p50", 1.0, 4.0, 25,
                       lambda x: (dataclasses.replace(cal, contention=x), cluster))


def fit_ttft_rows(doc: dict, cal: Calibration, cluster: Cluster) -> float:
    """Request overhead per decode row in flight (Calibration.ttft_row_ms): the value at which
    the median over requests of (simulated - measured TTFT), paired by trace index, is 0 in the
    simulated closed loop: an additive per-request term estimated as fit_idle estimates the
    fixed one, so the start-up burst of a closed loop (every client at once) does not weigh
    in as it would on the P50 of the run."""
    run, reqs = closed_run(doc, False)
    n = int(run["concurrency"])
    meas = {row.get("idx", i): row["ttft_ms"] for i, row in enumerate(run["requests"])
            if row.get("status") == "ok" and row.get("ttft_ms") is not None}
    if not meas:
        raise ValueError("--loaded: no completed request")

    def gap(x: float) -> float:
        fresh = [dataclasses.replace(r) for r in reqs]
        out = simulate(fresh, dataclasses.replace(cal, ttft_row_ms=x), cluster, concurrency=n)
        return statistics.median(r.ttft_ms - meas[r.idx] for r in out
                                 if r.idx in meas and r.ttft_ms is not None)

    return solve_increasing(gap, 0.0, 0.0, 50.0, 30)


def contention_from(alone: str, contended: str, shape: str) -> float:
    """Median over the cases both engine_costs results hold of (time with the other engines
    busy on the device) / (time alone)."""
    rows = {}
    for path in (alone, contended):
        d = json.loads(open(path).read())
        rows[path] = {r["case"]: r["eager_ms"] for r in d["results"]["rows"] if r.get("shape") == shape}
    both = [c for c in rows[contended] if c in rows[alone] and rows[alone][c] > 0]
    if not both:
        raise ValueError(f"--contended {contended}: no case in common with {alone}")
    return max(1.0, statistics.median(rows[contended][c] / rows[alone][c] for c in both))
