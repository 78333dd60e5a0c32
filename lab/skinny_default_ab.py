"""Decode steps on a GPU without a tuned skinny-GEMM table: the default (fused kernels at one
row only, cuBLAS above: engine/kernels/skinny_configs.DEFAULT_MAX_M) against the fused
heuristic up to --old-max rows, whole Engine.step() times (overlapped decode, CUDA graphs),
interleaved A/B by round. On a GPU that has a table (the H200), --no-table points the engine
at a missing table file so both sides run untuned.

    python -m lab.skinny_default_ab [--model dummy:llama-3.2-1b] [--batches 1,2,4,8,16,32]
        [--ctx 256] [--rounds 3] [--old-max 16] [--no-table]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics

import torch

from bench.common import print_table, write_result
from bench.engine_costs import decode_ms
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.kernels.options import KernelOptions


def build(model: str, max_batch: int | None, no_table: bool, kv_bytes: int) -> Engine:
    kern = KernelOptions(skinny_table="/nonexistent/skinny_gemm.json") if no_table else KernelOptions()
    return Engine(EngineConfig(model=ModelConfig(model, dtype="bf16"),
                               cache=CacheConfig(kv_cache_bytes=kv_bytes),
                               scheduler=SchedulerConfig(max_num_seqs=256),
                               device=DeviceConfig(device="cuda", skinny_gemm_max_batch=max_batch),
                               kernels=kern))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.skinny_default_ab")
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-max", type=int, default=16)
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    sides = {"default": None, f"fused<={a.old_max}": a.old_max}
    times: dict = {(s, b): [] for s in sides for b in batches}
    rng = random.Random(0)
    for r in range(a.rounds):
        for side, mx in sides.items():
            eng = build(a.model, mx, a.no_table, a.kv_cache_bytes)
            for b in batches:
                times[(side, b)].append(decode_ms(eng, rng, b, a.ctx, f"{side}{r}b{b}", steps=9))
            del eng
            gc.collect()
            torch.cuda.empty_cache()
        print(f"round {r + 1} done", flush=True)
    rows = []
    for b in batches:
        new, old = (statistics.median(times[(s, b)]) for s in sides)
        rows.append({"batch": b, "default_ms": round(new, 3), "old_ms": round(old, 3),
                     "old/default": round(old / new, 3)})
    print(f"{a.model} on {torch.cuda.get_device_name()}, ctx {a.ctx}, whole decode steps "
          f"(median of {a.rounds} rounds){', no table' if a.no_table else ''}:")
    print_table(rows, ["batch", "default_ms", "old_ms", "old/default"])
    write_result("skinny_default_ab", vars(a), {"rows": rows, "runs": {f"{s} b={b}": v for (s, b), v in times.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
