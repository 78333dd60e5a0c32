"""Where a decode step's time goes on the GPU: the serving path's CUDA-graph step under
torch.profiler (CUPTI records the kernels a graph replay launches): kernel time per kernel,
launches per step, and the gap = step wall time - summed kernel time (launch latency,
dependency waits, host staging), which PDL and fewer kernels per layer attack.

    python -m bench.step_profile [--cases llama-3.2-1b:1:1024,llama-3.1-8b:64:2048:fused]

A case's optional 4th field `fused` runs the fused skinny matmuls for every batch up to 64
rows (else the tuned table decides, as in serving).
"""
from __future__ import annotations

import argparse
import gc
import logging
from collections import defaultdict

import torch

from bench.common import print_table, write_result
from bench.engine_gpu_steps import decode_inputs, make_engine
from bench.timing import cuda_time_ms
from engine.runner import StepInput

KINDS = (("skinny", "matmul (fused skinny)"), ("gemm", "matmul (cuBLAS)"), ("nvjet", "matmul (cuBLAS)"),
         ("cutlass", "matmul (cuBLAS)"), ("decode_split", "attention"), ("decode_reduce", "attention"),
         ("rope", "rotary + kv write"), ("kv_write", "rotary + kv write"), ("rms", "norm"),
         ("memcpy", "host staging copy"), ("Memcpy", "host staging copy"))


def kind_of(name: str) -> str:
    return next((k for pat, k in KINDS if pat in name), "other")


@torch.inference_mode()
def profile_case(shape: str, batch: int, ctx: int, steps: int = 20, fused: bool = False) -> list[dict]:
    eng = make_engine(shape, batch, ctx, eager=False, num_blocks=batch * (-(-(ctx + 1) // 16)) + 8,
                      prefill_graphs=False, skinny_max_batch=64 if fused else None)
    r = eng.runner
    ids, _, meta = decode_inputs(eng, batch, ctx)
    bt = meta.block_tables.tolist()
    rows = [StepInput(f"b{i}", [int(t)], ctx, bt[i], True) for i, t in enumerate(ids.tolist())]
    wall_ms = cuda_time_ms(lambda: r.graphs.run_rows(rows), iters=50)
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
    case = f"{shape} b={batch} ctx={ctx}" + (" fused" if fused else "")
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
    del eng, r
    gc.collect()
    torch.cuda.empty_cache()
    return out[:25] + summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-3.2-1b:1:1024,llama-3.1-8b:1:1024,llama-3.1-8b:64:2048")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for spec in a.cases.split(","):
        shape, b, c, *flag = spec.split(":")
        got = profile_case(shape, int(b), int(c), fused=flag == ["fused"])
        print_table(got, ["case", "kernel", "kind", "us_per_step", "launches_per_step"])
        rows += got
    print("wrote", write_result("step_profile", {"cases": a.cases, "dtype": "bf16"}, {"rows": rows}))


if __name__ == "__main__":
    main()
