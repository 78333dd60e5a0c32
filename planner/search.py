"""The shape search on the simulator: from the queueing model's answer (a fast first guess),
grow the side whose SLO is missed until the simulated quantiles meet both SLOs, then shrink
each side while they still do. Split: prefill replicas for TTFT, decode replicas for TPOT;
colocated: one replica count for both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from planner.calibration import Calibration
from planner.replay import summarize
from planner.simulate import Cluster, SimRequest, simulate


@dataclass(frozen=True)
class SimPoint:
    shape: str
    prefill: int
    decode: int
    figures: dict        # planner/replay.summarize, with ttft_ms_q / tpot_ms_q
    meets: bool


def _fresh(reqs: list[SimRequest]) -> list[SimRequest]:
    return [SimRequest(r.idx, r.arrival_ms, r.input_len, r.output_len) for r in reqs]


STALE_GROWS = 3


def _miss(f: dict, ttft_ms: float, tpot_ms: float) -> float:
    """How far a shape is from the SLOs: the larger quantile / SLO ratio, and rejections."""
    tpot = f["tpot_ms_q"] / tpot_ms if f["tpot_ms_q"] == f["tpot_ms_q"] else 0.0
    return max(f["ttft_ms_q"] / ttft_ms, tpot) + f["rejected"]


def search(reqs: list[SimRequest], cal: Calibration, base: Cluster, ttft_ms: float, tpot_ms: float,
           quantile: float, start: tuple[int, int], max_replicas: int = 256) -> tuple[SimPoint, list[SimPoint]]:
    """-> (the smallest shape found meeting both SLOs at `quantile`, every shape simulated).
    ValueError when none within max_replicas does."""
    seen: dict[tuple[int, int], SimPoint] = {}
    colo = base.prefill == 0

    def run(p: int, d: int) -> SimPoint:
        if (p, d) not in seen:
            c = replace(base, prefill=p, decode=d)
            out = simulate(_fresh(reqs), cal, c, ttft_ms if base.admission else None)
            f = summarize(out, ttft_ms, tpot_ms, quantile)
            # NaN TPOT (one-token outputs) meets it: no gap to be late
            ok = f["rejected"] == 0 and f["ttft_ms_q"] <= ttft_ms and not f["tpot_ms_q"] > tpot_ms
            seen[(p, d)] = SimPoint(c.shape, p, d, f, ok)
        return seen[(p, d)]

    p, d = (0, max(1, start[1])) if colo else (max(1, start[0]), max(1, start[1]))
    best_miss, stale = float("inf"), 0
    while not (pt := run(p, d)).meets:
        f = pt.figures
        # NOTE: replicas sharing a fixed number of devices (Cluster.devices) under contention
        # can stop helping: give up once STALE_GROWS more replicas did not cut the miss
        miss = _miss(f, ttft_ms, tpot_ms)
        stale = 0 if miss < 0.98 * best_miss else stale + 1
        best_miss = min(best_miss, miss)
        if stale >= STALE_GROWS:
            where = f" on {base.devices} device(s)" if base.devices else ""
            raise ValueError(f"no shape meets the SLOs in simulation{where}: {STALE_GROWS} more "
                             f"replicas from {pt.shape} did not bring the quantiles closer")
        slow_ttft = f["rejected"] > 0 or f["ttft_ms_q"] > ttft_ms
        if colo:
            d += 1
        else:
            p += slow_ttft
            d += f["tpot_ms_q"] > tpot_ms
        if p + d > max_replicas:
            raise ValueError(f"no shape of up to {max_replicas} replicas meets the SLOs in simulation")
    while not colo and p > 1 and run(p - 1, d).meets:
        p -= 1
    while d > 1 and run(p, d - 1).meets:
        d -= 1
    return run(p, d), sorted(seen.values(), key=lambda s: (s.prefill + s.decode, s.prefill))
