"""Workloads for the simulator in the serving benchmark's trace format, and its figures with
the benchmark's definitions (bench/serve_stats.py).

The trace comes from bench/serve_trace.py itself (same seed, same lengths and arrival gaps as
`python -m bench.serve` sends), or from a bench.serve result: its config and each load point's
request count give back the exact trace that run sent.
"""
from __future__ import annotations

import math

import numpy as np

from bench.serve_trace import TraceSpec, arrival_times, build_trace
from planner.simulate import SimRequest


def trace_requests(n: int, rate: float, input_len: str, output_len: str, seed: int = 0,
                   arrival: str = "poisson", burstiness: float = 1.0) -> list[SimRequest]:
    """n requests as bench.serve builds them for one open-loop point at `rate` requests/s."""
    reqs = build_trace(TraceSpec(num_requests=n, input_len=input_len, output_len=output_len,
                                 seed=seed), vocab=1000)
    times = arrival_times(n, rate, arrival, burstiness, seed)
    return [SimRequest(r.idx, t * 1e3, r.input_len, r.max_tokens) for r, t in zip(reqs, times)]


def lognormal_spec(mean: float, cv: float) -> str:
    """The trace length spec of a lognormal with this mean and std/mean (fixed when cv is 0)."""
    if cv == 0:
        return f"fixed:{max(1, round(mean))}"
    s = math.sqrt(math.log1p(cv * cv))
    return f"lognormal:{mean / math.exp(s * s / 2):.6g},{s:.6g}"


def bench_points(doc: dict) -> list[dict]:
    """Each open-loop point of a bench.serve result -> {rate, label, requests (SimRequests of the
    trace it sent), measured (its summary), rows}."""
    if "runs" not in doc.get("results", {}) or "input_len" not in doc.get("config", {}):
        raise ValueError(f"a {doc.get('benchmark')!r} result: want a bench.serve result")
    cfg = doc["config"]
    if cfg.get("jsonl") or cfg.get("prefix_share"):
        raise ValueError("only synthetic traces without shared prefixes can be replayed")
    out = []
    for run in doc["results"]["runs"]:
        if "rate" not in run:
            continue  # closed loop: no arrival times to replay
        rows = run["requests"]
        reqs = trace_requests(len(rows), run["rate"], cfg["input_len"], cfg["output_len"],
                              cfg.get("seed", 0), cfg.get("arrival") or "poisson",
                              cfg.get("burstiness") or 1.0)
        out.append({"rate": run["rate"], "label": run.get("label"), "requests": reqs,
                    "measured": run["summary"], "rows": rows})
    if not out:
        raise ValueError("no open-loop (--rate / --rates) point in this result")
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(reqs: list[SimRequest], ttft_slo_ms: float | None = None,
              tpot_slo_ms: float | None = None, quantile: float | None = None) -> dict:
    """bench/serve_stats.summarize's figures; with `quantile` also ttft_ms_q / tpot_ms_q there."""
    ok = [r for r in reqs if r.status == "ok"]
    good = [r for r in ok if (ttft_slo_ms is None or r.ttft_ms <= ttft_slo_ms) and
            (tpot_slo_ms is None or r.tpot_ms is None or r.tpot_ms <= tpot_slo_ms)]
    t0 = min(r.arrival_ms for r in reqs)
    wall_s = max(max((r.end_ms for r in reqs if r.end_ms is not None), default=t0) - t0, 1e-6) / 1e3
    ttft = [r.ttft_ms for r in ok]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    s = {"requests": len(reqs), "completed": len(ok), "rejected": len(reqs) - len(ok),
         "wall_s": wall_s, "throughput_rps": len(ok) / wall_s, "goodput_rps": len(good) / wall_s,
         "output_tok_s": sum(r.output_len for r in ok) / wall_s,
         "slo_attainment": len(good) / len(reqs)}
    for q in (50, 90, 99):
        s[f"ttft_ms_p{q}"] = pct(ttft, q)
        s[f"tpot_ms_p{q}"] = pct(tpot, q)
    if quantile is not None:
        s["ttft_ms_q"], s["tpot_ms_q"] = pct(ttft, quantile * 100), pct(tpot, quantile * 100)
    return s
