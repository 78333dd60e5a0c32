"""The capacity a rate sweep is scaled by (`bench.serve --rates auto:F1,F2,...`):

    closed  throughput of --peak-concurrency closed-loop clients (fast; a floor on capacity
            where that many clients do not fill the server)
    slo     the highest open-loop rate whose SLO attainment reaches --peak-attainment with the
            SLO measured but not sent (no admission): the server's own goodput capacity, as
            DistServe defines per-GPU goodput. Starts from the closed-loop figure, steps by
            x1.5 up while attainment holds (down while it fails), then bisects the bracket.
Each probe gets fresh prompt tokens (its own content seed), so none is served from the prefix
cache an earlier probe warmed."""
from __future__ import annotations

import dataclasses

from bench.serve_client import run_load
from bench.serve_stats import summarize
from bench.serve_trace import arrival_times, build_trace

STEP = 1.5
MAX_STEPS = 6
BISECTIONS = 2
CONTENT_BASE = 1000  # content seeds of the probes (load points use small ones)


async def closed_peak(cfg, spec, vocab: int, a) -> float:
    n = a.num_requests or 4 * a.peak_concurrency
    reqs = build_trace(dataclasses.replace(spec, num_requests=n), vocab, CONTENT_BASE - 1)
    outs, wall = await run_load(cfg, reqs, None, a.peak_concurrency, "peak")
    s = summarize(outs, wall)
    if not s["completed"]:
        raise SystemExit(f"peak run: no request completed ({s['errors_by_code']})")
    return s["throughput_rps"]


async def probe(cfg, spec, vocab: int, rate: float, k: int, a) -> dict:
    n = max(4, round(rate * a.peak_duration))
    reqs = build_trace(dataclasses.replace(spec, num_requests=n), vocab, CONTENT_BASE + k)
    times = arrival_times(n, rate, a.arrival, a.burstiness, a.seed + CONTENT_BASE + k)
    outs, wall = await run_load(dataclasses.replace(cfg, send_slo=False), reqs, times, 0,
                                f"peak probe {rate:.3g}/s")
    s = summarize(outs, wall, a.ttft_ms, a.tpot_ms, rate)
    return {"rate": rate, "requests": n, "attainment": s["slo_attainment"],
            "goodput_rps": s["goodput_rps"], "errors": s["errors"],
            "ttft_ms_p99": s["ttft_ms_p99"], "tpot_ms_p99": s["tpot_ms_p99"]}


async def slo_peak(cfg, spec, vocab: int, a, start: float) -> tuple[float, list[dict]]:
    """-> (the highest probed rate meeting the attainment target, every probe)."""
    if a.ttft_ms is None and a.tpot_ms is None:
        raise SystemExit("--peak slo needs --ttft-ms and/or --tpot-ms")
    target, probes = a.peak_attainment, []

    async def ok(rate: float) -> bool:
        probes.append(await probe(cfg, spec, vocab, rate, len(probes), a))
        return probes[-1]["attainment"] >= target

    lo = hi = None
    rate = start
    for _ in range(MAX_STEPS):
        if await ok(rate):
            lo = rate
            if hi is not None:
                break
            rate *= STEP
        else:
            hi = rate
            if lo is not None:
                break
            rate /= STEP
    if lo is None:
        raise SystemExit(f"peak search: SLO attainment below {target:g} even at {rate * STEP:.3g} req/s "
                         "with nothing else running; the SLO is beyond this server")
    if hi is not None:
        for _ in range(BISECTIONS):
            mid = (lo * hi) ** 0.5
            if await ok(mid):
                lo = mid
            else:
                hi = mid
    return lo, probes


async def measure_peak(cfg, spec, vocab: int, a) -> tuple[float, dict]:
    """-> (peak req/s, what was measured on the way)."""
    closed = await closed_peak(cfg, spec, vocab, a)
    if a.peak == "closed":
        return closed, {"method": "closed", "closed_rps": closed}
    peak, probes = await slo_peak(cfg, spec, vocab, a, closed)
    return peak, {"method": "slo", "closed_rps": closed, "attainment_target": a.peak_attainment,
                  "probes": probes}
