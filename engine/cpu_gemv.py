"""One-row fp32 matmuls on CPU (a single decode stream), chosen by measurement at load.

At one row a matmul is a GEMV bound by streaming its weight, and which library streams a shape
fastest depends on the CPU: on a 2-core AMD EPYC VM torch's sgemv (MKL) read SmolLM2's weights
at 11-22 GB/s where oneDNN's packed copy read them at 21-36 (memory copies: 32 GB/s); on a
2-core Xeon the packed copy was the slower one at one row (lab/notes/cpu_serving.md). So for
each distinct weight shape both run over that shape's weights (more bytes than the caches
hold: streamed, as in a step), and the faster serves its one-row calls:
    torch    F.linear on the weight as laid out ([in, out] storage under cpu_weight_layout)
    packed   oneDNN's packed copy (when cpu_packed_matmul made one)
`python -m bench.cpu_gemv` prints the candidates' GB/s per shape.
NOTE: both candidates run on torch's OpenMP threads. A second thread pool must not join the
step: numpy's OpenBLAS streams faster alone, but its workers spin beside torch's between calls
(a 2-core decode step 8x slower).
Results differ from F.linear's by fp32 rounding (summation order), as on the 2+ row path.
"""
from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear, packed_linear

log = logging.getLogger("splitserve.engine.cpu_gemv")


def _time(fns: dict, x: torch.Tensor, reps: int = 5) -> dict:
    """name -> median seconds of one pass over fns[name] (each pass a different weight per call:
    streamed, not cached), the candidates interleaved rep by rep so a drifting load hits all."""
    ts = {k: [] for k in fns}
    for r in range(reps + 1):
        for k, fs in fns.items():
            t0 = time.perf_counter()
            for f in fs:
                f(x)
            if r:  # the first pass warms (oneDNN builds its primitive)
                ts[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[reps // 2] for k, v in ts.items()}


@torch.no_grad()
def choose(mods: list, min_bytes: int = 64 << 20) -> dict:
    """mods: [(Linear-like with .weight/.bias/.packed/.packed_min_rows)] -> {shape: {candidate:
    seconds per call, "best": name}}; a shape whose packed copy is faster at one row gets
    packed_min_rows = 1 (else 2). Each candidate runs over the shape's weights, cycled to at
    least min_bytes."""
    by_shape = defaultdict(list)
    for m in mods:
        if m.weight.dtype == torch.float32:
            by_shape[tuple(m.weight.shape)].append(m)
    table = {}
    for shape, ms in by_shape.items():
        if any(m.packed is None for m in ms):
            continue  # nothing to choose from
        x = torch.randn(1, shape[1])
        nbytes = ms[0].weight.numel() * 4
        timed = [ms[i % len(ms)] for i in range(max(len(ms), -(-min_bytes // nbytes)))]
        fns = {"torch": [functools.partial(F.linear, weight=m.weight, bias=m.bias) for m in timed],
               "packed": [functools.partial(packed_linear, packed=m.packed, bias=m.bias) for m in timed]}
        cost = {k: v / len(timed) for k, v in _time(fns, x).items()}
        best = min(cost, key=cost.get)
        for m in ms:
            m.packed_min_rows = 1 if best == "packed" else 2
        table[shape] = {**cost, "best": best}
        log.debug("one-row matmul %s: %s", shape, {k: f"{v * 1e6:.0f}us" for k, v in cost.items()})
    return table


class _Head:
    """The LM head as a Linear-like for `choose` (tied or not, [out, in] view)."""

    def __init__(self, weight, packed):
        self.weight, self.bias, self.packed, self.packed_min_rows = weight, None, packed, 2


def setup(model, packed_head) -> tuple[dict, int]:
    """Chooses every fp32 Linear's and the LM head's one-row matmul -> (table, the rows from
    which the head uses packed_head)."""
    mods = [m for m in model.modules() if isinstance(m, Linear)]
    head = _Head(model.lm_head_weight, packed_head)
    table = choose(mods + [head])
    if table:
        log.info("cpu one-row matmuls: %s", ", ".join(
            f"{'x'.join(map(str, s))} {t['best']}" for s, t in table.items()))
    return table, head.packed_min_rows
