"""Cost models the planner runs on, fitted by least squares to measured points:

    prefill_ms(n)        = p0 + p1 * n + p2 * n^2      (n prompt tokens; n^2: attention)
    step_ms(batch, ctx)  = d0 + d1 * batch + d2 * batch * ctx + bend(batch)
                           (ctx: mean context; the KV read)
    handoff_ms(n)        = n * kv_bytes_per_token / kv_gbps (0 when kv_gbps is 0: colocated pool)

bend(batch): the engine's step is not linear in its batch (kernels are chosen by batch size:
CUDA-graph buckets, skinny GEMM vs cuBLAS), so the line's residual at each measured batch
(mean over the measured contexts) is kept as a knot and interpolated piecewise-linearly in
batch, held flat beyond the first and last knot. With it the fitted step passes through the
measured engine rows; without knots (given points of one batch, `curve=False`) it is the line.

Points come from a bench/results JSON (engine_gpu or engine_costs: its 'prefill N' and
'decode b=B ctx=C' rows for one model shape) or from flags ('N:ms' and 'BxC:ms')."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PREFILL_ROW = re.compile(r"^prefill (\d+)$")
DECODE_ROW = re.compile(r"^decode b=(\d+) ctx=(\d+)$")


@dataclass(frozen=True)
class Calibration:
    prefill: tuple[float, float, float]   # p0, p1, p2 (ms)
    decode: tuple[float, float, float]    # d0, d1, d2 (ms)
    kv_bytes_per_token: int = 0
    kv_gbps: float = 0.0
    source: str = "flags"
    points: dict = field(default_factory=dict, compare=False)
    ttft_overhead_ms: float = 0.0         # per request on top of prefill: gateway and RPC hops
    # a step's stretch while two replicas of one device are mid-step (1: no slowdown; 2: strict
    # time-slicing); k replicas: 1 + (contention - 1)(k - 1)
    contention: float = 1.0
    # serving-path cost a row per row of the batch (ms): streaming B tokens a step through
    # processes sharing the engine's cores costs more per token as B grows
    row_growth: float = 0.0
    contention_decode: bool = True       # False: only prefill (and colocated) replicas' steps stretch
    padded_attention: bool = False        # decode rows pay for the step's longest context (CPU)
    bend: tuple = ()                      # ((batch, ms), ...) ascending: step_ms's residual knots
    # serving-path time a request per decode row in flight when it arrives (ms): its RPC hops
    # cross event loops that are busy streaming those rows' tokens
    ttft_row_ms: float = 0.0

    def __post_init__(self):
        if self.ttft_row_ms < 0:
            raise ValueError(f"ttft_row_ms must be >= 0, got {self.ttft_row_ms}")
        if not self.contention >= 1.0:
            raise ValueError(f"contention must be >= 1 (a shared device never speeds a step), got {self.contention}")

    def prefill_ms(self, n: float) -> float:
        p0, p1, p2 = self.prefill
        return p0 + p1 * n + p2 * n * n

    def step_ms(self, batch: float, ctx: float) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * batch * ctx + self.bend_ms(batch)

    def bend_ms(self, batch: float) -> float:
        """The engine's measured departure from the line at this batch (0 without knots)."""
        k = self.bend
        if not k:
            return 0.0
        if batch <= k[0][0]:
            return k[0][1]
        for (b0, y0), (b1, y1) in zip(k, k[1:]):
            if batch <= b1:
                return y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
        return k[-1][1]

    def stretch(self, k: int) -> float:
        return 1.0 + (self.contention - 1.0) * max(0, k - 1)

    def handoff_ms(self, n: float) -> float:
        return n * self.kv_bytes_per_token / (self.kv_gbps * 1e6) if self.kv_gbps > 0 else 0.0


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0 (costs never shrink as their drivers grow):
    drop the most negative term and refit until none is negative."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * x.shape[1]
            for i, c in zip(keep, coef):
                out[i] = max(float(c), 0.0)
            return tuple(out)
        keep.pop(int(np.argmin(coef)))


def fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    if len(points) < 2:
        raise ValueError(f"prefill calibration needs >= 2 (tokens, ms) points, got {len(points)}")
    n = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    return _nonneg_lstsq(np.stack([np.ones_like(n), n, n * n], 1), y)


def fit_decode(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    if len(points) < 2:
        raise ValueError(f"decode calibration needs >= 2 (batch, ctx, ms) points, got {len(points)}")
    b = np.array([p[0] for p in points], dtype=float)
    c = np.array([p[1] for p in points], dtype=float)
    y = np.array([p[2] for p in points], dtype=float)
    return _nonneg_lstsq(np.stack([np.ones_like(b), b, b * c], 1), y)


def fit_bend(points: list[tuple[int, int, float]], decode: tuple[float, float, float]) -> tuple:
    """((batch, mean residual ms), ...) of the decode points against the fitted line; () when
    the points have fewer than two batches (nothing to bend between)."""
    d0, d1, d2 = decode
    res: dict[int, list[float]] = {}
    for b, c, ms in points:
        res.setdefault(int(b), []).append(ms - (d0 + d1 * b + d2 * b * c))
    if len(res) < 2:
        return ()
    return tuple((float(b), float(np.mean(r))) for b, r in sorted(res.items()))


def kv_bytes_per_token(shape: str, kv_dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token of a named model shape (engine/loader/dummy.py)."""
    from engine.loader.dummy import SHAPES

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: one of {', '.join(sorted(SHAPES))}")
    a = SHAPES[shape]
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * kv_dtype_bytes


def points_from_bench(path: str | Path, shape: str) -> tuple[list, list]:
    """(prefill points, decode points) of one model shape from an engine_gpu / engine_costs result."""
    d = json.loads(Path(path).read_text())
    if d.get("benchmark") not in ("engine_gpu", "engine_costs"):
        raise ValueError(f"{path}: a {d.get('benchmark')!r} result; calibration reads engine_gpu "
                         "or engine_costs results")
    pre, dec = [], []
    for r in d["results"]["rows"]:
        if r.get("shape") != shape:
            continue
        ms = r.get("graph_ms") if r.get("graph_ms") is not None else r.get("eager_ms")
        if ms is None:
            continue
        if m := PREFILL_ROW.match(r["case"]):
            pre.append((int(m.group(1)), float(ms)))
        elif m := DECODE_ROW.match(r["case"]):
            dec.append((int(m.group(1)), int(m.group(2)), float(ms)))
    if not pre or not dec:
        shapes = sorted({r.get("shape") for r in d["results"]["rows"]} - {None})
        raise ValueError(f"{path}: no prefill / decode rows for shape {shape!r} (it has {', '.join(shapes)})")
    return pre, dec


def parse_points(spec: str, decode: bool) -> list[tuple]:
    """'128:6.0,512:14' (prefill tokens:ms) or '1x1024:4.1,64x1024:7.4' (decode batch x ctx:ms)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            x, ms = item.split(":")
            if decode:
                b, c = x.lower().split("x")
                out.append((int(b), int(c), float(ms)))
            else:
                out.append((int(x), float(ms)))
        except ValueError:
            want = "BATCHxCTX:MS" if decode else "TOKENS:MS"
            raise ValueError(f"bad point {item!r}: write {want}, comma-separated") from None
    return out


def calibrate(prefill_points: list, decode_points: list, kv_bytes: int = 0, kv_gbps: float = 0.0,
              source: str = "flags", ttft_overhead_ms: float = 0.0, curve: bool = True) -> Calibration:
    """The fits; `curve`: keep the decode line's residual knots (Calibration.bend)."""
    if ttft_overhead_ms < 0:
        raise ValueError(f"ttft_overhead_ms must be >= 0, got {ttft_overhead_ms}")
    dec = fit_decode(decode_points)
    return Calibration(fit_prefill(prefill_points), dec, kv_bytes, kv_gbps,
                       source, {"prefill": prefill_points, "decode": decode_points}, ttft_overhead_ms,
                       bend=fit_bend(decode_points, dec) if curve else ())
