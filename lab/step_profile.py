"""Where a decode step's time goes on the GPU: the serving path's CUDA-graph step under
torch.profiler (CUPTI records the kernels a graph replay launches): kernel time per kernel,
launches per step, and the gap = step wall time - summed kernel time (launch latency,
dependency waits, host staging), which PDL and fewer kernels per layer attack.

    python -m lab.step_profile [--cases llama-3.2-1b:1:1024,llama-3.1-8b:64:2048:fused]
                               [--timeline | --stamps] [--table CANDIDATE.json]
                               [--kernel-options NAME=VALUE[,...]]

A case's optional 4th field `fused` runs the fused skinny matmuls for every batch up to 64
rows (else the tuned table decides, as in serving).
--timeline: the step's kernels in launch order, folded into the per-layer pattern: for each
position in a layer (qkv, attention split, reduce, o_proj, ...), the median over layers of
its duration (first program start to last program end; with PDL that includes time spent
waiting for the previous kernel) and of what it adds to the step (its end minus the previous
kernel's end): the in-step counterpart of an isolated timing, to compare a table's ops
inside the step (--table runs the engine on a candidate skinny-GEMM table instead, i.e.
KernelOptions.skinny_table; --kernel-options builds it with other KernelOptions, the spec of
lab.decode_ab --kernel-options-b).
--stamps: the step captured with in-kernel timestamps (KernelOptions.trace, engine/kernels/
trace.py; add trace_probe=True to --kernel-options for the split's first loads): per position
of the per-layer pattern, medians over layers and replays, in us relative to the previous
kernel's last program end (t=0): when its first program became resident, when its
grid-dependency wait released (first / last program), the decode split's midpoints (rotary +
new K/V written; its tiles attended), when its programs ended (median / last = what it adds).
Last, the registers / spills / shared memory of every kernel variant the cases compiled, as
this GPU's Triton reports them, and how many programs of each fit on one SM
(lab/kernel_resources.py).
"""
from __future__ import annotations

import argparse
import gc
import logging
from collections import defaultdict
from dataclasses import replace

import torch

from bench.common import kernel_options, print_table, with_kernels, write_result
from bench.engine_gpu_steps import decode_inputs, make_engine, rows_of
from lab.kernel_resources import COLUMNS as RES_COLUMNS
from lab.kernel_resources import compiled_rows
from bench.timing import cuda_time_ms
from engine.kernels import trace
from engine.kernels.options import KernelOptions

KINDS = (("skinny", "matmul (fused skinny)"), ("gemm", "matmul (cuBLAS)"), ("nvjet", "matmul (cuBLAS)"),
         ("cutlass", "matmul (cuBLAS)"), ("decode_split", "attention"), ("decode_reduce", "attention"),
         ("rope", "rotary + kv write"), ("kv_write", "rotary + kv write"), ("rms", "norm"),
         ("memcpy", "host staging copy"), ("Memcpy", "host staging copy"))


def kind_of(name: str) -> str:
    return next((k for pat, k in KINDS if pat in name), "other")


def layer_pattern(names: list[str], layers: int, max_prologue: int = 16) -> tuple[int, int] | None:
    """(start, period) of the longest-repeating per-layer kernel pattern: the smallest period p
    such that from some start <= max_prologue the names repeat with period p over at least
    layers - 2 layers (the first and last layer may differ: a separate norm, the final norm)."""
    run = max(1, layers - 2)
    for p in range(1, len(names) // run + 1):
        for s0 in range(0, max_prologue + 1):
            seq = names[s0:s0 + p * run]
            if len(seq) == p * run and all(seq[i] == seq[i + p] for i in range(len(seq) - p)):
                return s0, p
    return None


def per_position(kernels: list[tuple[str, float, float]], layers: int) -> list[dict]:
    """kernels: (name, start_us, end_us) of one step in start order. Per position of the
    per-layer pattern: median duration and median adds (end - previous kernel's end)."""
    found = layer_pattern([k[0] for k in kernels], layers)
    if found is None:
        return []
    s0, p = found
    n_layers = (len(kernels) - s0) // p
    while n_layers > 0 and [k[0] for k in kernels[s0 + (n_layers - 1) * p:s0 + n_layers * p]] != \
            [k[0] for k in kernels[s0:s0 + p]]:
        n_layers -= 1
    out = []
    for q in range(p):
        durs, adds = [], []
        for j in range(n_layers):
            i = s0 + j * p + q
            name, start, end = kernels[i]
            durs.append(end - start)
            adds.append(end - (kernels[i - 1][2] if i > 0 else start))
        durs.sort()
        adds.sort()
        out.append({"pos": q, "kernel": kernels[s0 + q][0][:40], "layers": n_layers,
                    "median_us": round(durs[len(durs) // 2], 2), "adds_us": round(adds[len(adds) // 2], 2)})
    return out


def step_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the GPU kernels a profiler recorded, in start order."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda k: k[1])


@torch.inference_mode()
def profile_case(shape: str, batch: int, ctx: int, steps: int = 20, fused: bool = False,
                 timeline: bool = False, stamps: bool = False,
                 kernels: KernelOptions = KernelOptions()) -> list[dict]:
    trace.reset()
    eng = make_engine(shape, batch, ctx, eager=False, num_blocks=batch * (-(-(ctx + 1) // 16)) + 8,
                      prefill_graphs=False, skinny_max_batch=64 if fused else None)
    # the engine on these options (its graphs captured with the stamps when tracing)
    eng = with_kernels(eng, replace(kernels, trace=kernels.trace or stamps))
    r = eng.runner
    ids, _, meta = decode_inputs(eng, batch, ctx)
    rows = rows_of(ids, meta, ctx)
    wall_ms = cuda_time_ms(lambda: r.graphs.run_rows(rows), iters=50)  # (also the warm-up)
    case = f"{shape} b={batch} ctx={ctx}" + (" fused" if fused else "")
    try:
        if stamps:
            return _stamp_rows(r, rows, case, steps)
        if timeline:
            return _timeline_rows(r, rows, case)
        return _kernel_sum_rows(r, rows, case, steps, wall_ms)
    finally:
        del eng, r
        trace.reset()
        gc.collect()
        torch.cuda.empty_cache()


def _timeline_rows(r, rows, case: str) -> list[dict]:
    """One replay alone, its kernels folded into the per-layer pattern."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as one:
        r.graphs.run_rows(rows)
        torch.cuda.synchronize()
    ks = [k for k in step_kernels(one) if "Memcpy" not in k[0]]
    pos = [{"case": case, **row} for row in per_position(ks, r.model.arch.num_layers)]
    if ks:
        pos.append({"case": case, "kernel": "[first start to last end]",
                    "median_us": round(ks[-1][2] - ks[0][1], 1), "layers": len(ks)})
    return pos


STAMP_COLS = ["first_in", "in_median", "wait_first", "wait_last", "rope_kv", "probe_bt", "probe_kv",
              "attended", "end_median", "end_last", "unwritten"]


def stamp_features(bufs: list[tuple[str, "torch.Tensor"]]) -> list[dict]:
    """One replay's stamps (kernel name, int64 [programs, 8] ns, in launch order) -> per
    launch, times in us relative to the previous launch's last program end."""
    out, prev_end = [], None
    for name, b in bufs:
        b = b.double()
        # a row no program wrote (stale memory) lies far from the others: left out, counted
        ok = (b[:, 1] > 0) & ((b[:, 1] - b[:, 1].median()).abs() < 1e9) & (b[:, 5] >= b[:, 1])
        bad = int((~ok).sum())
        b = b[ok] if bool(ok.any()) else b
        ref = prev_end if prev_end is not None else b[:, 1].min()
        us = lambda v: float((v - ref) / 1e3)  # noqa: E731
        row = {"kernel": name, "programs": b.shape[0], "sms": int(b[:, 0].unique().numel()),
               "first_in": us(b[:, 1].min()), "in_median": us(b[:, 1].median()),
               "wait_first": us(b[:, 2].min()),
               "wait_last": us(b[:, 2].max()), "end_median": us(b[:, 5].median()),
               "end_last": us(b[:, 5].max())}
        if bad:
            row["unwritten"] = bad
        if name == "decode_split":
            row["rope_kv"] = us(b[:, 3].median())
            row["attended"] = us(b[:, 4].max())
            if bool(((b[:, 6] >= b[:, 1]) & (b[:, 7] >= b[:, 6]) & (b[:, 7] <= b[:, 5])).all()):
                # KernelOptions.trace_probe: block ids, then K/V loaded
                row["probe_bt"] = us(b[:, 6].median())
                row["probe_kv"] = us(b[:, 7].median())
        out.append(row)
        prev_end = b[:, 5].max()
    return out


def fold_stamps(reps: list[list[dict]], layers: int) -> list[dict]:
    """Per position of the per-layer pattern: the median over layers and replays of each
    stamp feature."""
    names = [f["kernel"] for f in reps[0]]
    found = layer_pattern(names, layers)
    if found is None:
        return []
    s0, p = found
    n_layers = (len(names) - s0) // p
    out = []
    for q in range(p):
        vals: dict[str, list[float]] = defaultdict(list)
        for feats in reps:
            for j in range(n_layers):
                f = feats[s0 + j * p + q]
                for c in STAMP_COLS:
                    if c in f:
                        vals[c].append(f[c])
        f0 = reps[0][s0 + q]
        row = {"pos": q, "kernel": f0["kernel"], "programs": f0["programs"], "sms": f0["sms"]}
        for c, v in vals.items():
            v.sort()
            row[c] = round(v[len(v) // 2], 2)
        out.append(row)
    return out


def _stamp_rows(r, rows, case: str, steps: int) -> list[dict]:
    """`steps` replays of the step captured with in-kernel timestamps, folded per layer."""
    g = r.graphs
    captured = [b for b in reversed(g.buckets) if b in g.graphs]  # capture order: largest first
    per = len(trace.RECORDS) // max(1, len(captured))
    if not per or per * len(captured) != len(trace.RECORDS):
        raise RuntimeError(f"{len(trace.RECORDS)} traced launches for {len(captured)} captured "
                           "buckets (a GPU with graphs is needed)")
    i = captured.index(g.bucket_for(len(rows)))
    bufs = trace.RECORDS[i * per:(i + 1) * per]  # the replayed bucket's launches
    reps, step_us, tick = [], [], None
    for _ in range(steps):
        r.graphs.run_rows(rows)
        torch.cuda.synchronize()
        host = [(n, b.cpu()) for n, b in bufs]
        feats = stamp_features(host)
        reps.append(feats)
        allt = torch.cat([b[:, 1:6].reshape(-1) for _, b in host]).unique()
        d = allt[1:] - allt[:-1]
        t = int(d[d > 0].min()) if d.numel() else 0
        tick = t if tick is None else min(tick, t)
        # first entry to last end: each launch's end_last is relative to the one before it
        step_us.append(sum(f["end_last"] for f in feats))
    step_us.sort()
    out = [{"case": case, **row} for row in fold_stamps(reps, r.model.arch.num_layers)]
    out.append({"case": case, "kernel": f"[traced launches {len(bufs)}, timer tick {tick} ns, "
                f"first entry to last end, median]", "end_last": round(step_us[len(step_us) // 2], 1)})
    return out


def _kernel_sum_rows(r, rows, case: str, steps: int, wall_ms: float) -> list[dict]:
    """Kernel time per kernel name and kind over `steps` replays, against the wall time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            r.graphs.run_rows(rows)
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        per_name[e.key][0] += t / steps  # us per step
        per_name[e.key][1] += e.count / steps
    kern_us = sum(v[0] for v in per_name.values())
    out = [{"case": case, "kernel": k[:70], "kind": kind_of(k), "us_per_step": round(v[0], 1),
            "launches_per_step": round(v[1], 1)}
           for k, v in sorted(per_name.items(), key=lambda kv: -kv[1][0])]
    by_kind: dict[str, float] = defaultdict(float)
    for row in out:
        by_kind[row["kind"]] += row["us_per_step"]
    summary = [{"case": case, "kernel": f"[{k}]", "kind": k, "us_per_step": round(v, 1)}
               for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    summary.append({"case": case, "kernel": "[all kernels]", "us_per_step": round(kern_us, 1),
                    "launches_per_step": round(sum(v[1] for v in per_name.values()), 1)})
    summary.append({"case": case, "kernel": "[step wall time, graph replay]", "us_per_step": round(wall_ms * 1e3, 1)})
    summary.append({"case": case, "kernel": "[gap: wall - kernels]", "us_per_step": round(wall_ms * 1e3 - kern_us, 1)})
    return out[:25] + summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-3.2-1b:1:1024,llama-3.1-8b:1:1024,llama-3.1-8b:64:2048")
    ap.add_argument("--timeline", action="store_true", help="per-layer kernel pattern, in-step times")
    ap.add_argument("--stamps", action="store_true", help="in-kernel timestamps, per-layer phases")
    ap.add_argument("--table", default=None, help="a candidate skinny-GEMM table file to run with")
    ap.add_argument("--kernel-options", default="", metavar="NAME=VALUE[,...]",
                    help="KernelOptions of the engine, e.g. pdl_rmsnorm=True (lab.decode_ab's spec)")
    a = ap.parse_args()
    try:
        kernels = kernel_options(a.kernel_options)
    except ValueError as e:
        ap.error(str(e))
    if a.table:
        kernels = replace(kernels, skinny_table=a.table)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for spec in a.cases.split(","):
        shape, b, c, *flag = spec.split(":")
        got = profile_case(shape, int(b), int(c), fused=flag == ["fused"], timeline=a.timeline,
                           stamps=a.stamps, kernels=kernels)
        cols = (["case", "pos", "kernel", "programs", "sms", *STAMP_COLS] if a.stamps
                else ["case", "pos", "kernel", "layers", "median_us", "adds_us"] if a.timeline
                else ["case", "kernel", "kind", "us_per_step", "launches_per_step"])
        print_table(got, cols)
        rows += got
    res = compiled_rows()  # registers / shared memory of what the cases compiled, per variant
    if res:
        print_table(res, RES_COLUMNS)
    print("wrote", write_result("step_profile", {"cases": a.cases, "dtype": "bf16", "timeline": a.timeline,
                                                 "stamps": a.stamps,
                                                 "table": a.table, "kernel_options": a.kernel_options}, {"rows": rows, "kernel_resources": res}))


if __name__ == "__main__":
    main()
