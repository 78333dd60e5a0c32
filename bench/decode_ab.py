"""A/B of decode-path options on one GPU, with interleaved captures (A, B, A, B, ...) and
medians, because re-capturing the same graph moves step times by up to 5% on the H200.

    python -m bench.decode_ab [--shapes llama-3.1-8b,llama-3.2-1b] [--reps 3]

1. Kernel: paged decode attention grid order, (S, Hkv, splits) vs (Hkv, S, splits), on
   scattered KV blocks (Llama-3.1-8B heads), CUDA-graph timed.
2. Engine, whole decode steps replayed as CUDA graphs (random bf16 weights of the shape):
   - o_proj weight L2 prefetch from the attention kernel, off vs on (fused path batches);
   - attention grid order, at batch 64.
Prints a table (median ms of each side, B/A) and writes bench/results/decode_ab-*.json.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics

import torch

import engine.kernels.decode_attention as da
from bench.common import print_table, write_result
from bench.engine_gpu_steps import copy_bandwidth_gbs, make_engine, time_decode
from bench.timing import graph_time_ms

HQ, HKV, D, BS = 32, 8, 128, 16
ATTN_CASES = [(1, 1024), (8, 1024), (32, 4096), (64, 2048), (128, 1024)]


def _attn_inputs(batch: int, ctx: int):
    nblk = -(-ctx // BS)
    cache = torch.randn(batch * nblk + 1, 2, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(batch * nblk, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, nblk)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, cache, bt, lens


def attention_grid_order(reps: int) -> list[dict]:
    rows = []
    for batch, ctx in ATTN_CASES:
        q, cache, bt, lens = _attn_inputs(batch, ctx)
        nbytes = batch * ctx * HKV * D * 2 * 2
        t = {False: [], True: []}
        for _ in range(reps):
            for hf in (False, True):
                fn = lambda: da.paged_decode_attention(q, cache, bt, lens, D ** -0.5, heads_first=hf)  # noqa: E731
                t[hf].append(graph_time_ms([fn] * 20) * 1e3)
        a, b = statistics.median(t[False]), statistics.median(t[True])
        rows.append({"case": f"attn b={batch} ctx={ctx}", "A": "S-major", "B": "heads-first",
                     "A_us": round(a, 2), "B_us": round(b, 2), "B/A": round(b / a, 3),
                     "A_GB/s": round(nbytes / a / 1e3), "B_GB/s": round(nbytes / b / 1e3),
                     "samples": {"A": t[False], "B": t[True]}})
        print("  ", {k: v for k, v in rows[-1].items() if k != "samples"}, flush=True)
        del q, cache, bt, lens
    return rows


def _ab(eng, shape: str, name: str, cases, set_a, set_b, reps: int, max_ctx: int) -> list[dict]:
    t = {c: {"A": [], "B": []} for c in cases}
    for _ in range(reps):
        for side, setter in (("A", set_a), ("B", set_b)):
            setter()
            eng.runner.maybe_capture_graphs(max_ctx + 64, eng.runner.model.attn_backend.name)
            for b, c in cases:
                t[(b, c)][side].append(time_decode(eng, b, c, eager=False)["graph_ms"])
    rows = []
    for (b, c), s in t.items():
        a, bb = statistics.median(s["A"]), statistics.median(s["B"])
        rows.append({"shape": shape, "case": f"{name} b={b} ctx={c}", "A_ms": round(a, 4),
                     "B_ms": round(bb, 4), "B/A": round(bb / a, 4), "samples": s})
        print("  ", {k: v for k, v in rows[-1].items() if k != "samples"}, flush=True)
    return rows


def engine_ab(shape: str, reps: int) -> list[dict]:
    cases_pf = [(1, 1024), (4, 1024), (16, 1024)]
    cases_grid = [(1, 1024), (64, 2048)]
    max_ctx = 2048
    nb = 64 * (-(-(max_ctx + 1) // BS)) + 8
    eng = make_engine(shape, 64, max_ctx, eager=False, num_blocks=nb, prefill_graphs=False)
    model = eng.runner.model
    rows = []

    def pf(on):
        return lambda: setattr(model, "decode_l2_prefetch", on)

    rows += _ab(eng, shape, "o_proj L2 prefetch off(A)/on(B)", cases_pf, pf(False), pf(True), reps, max_ctx)
    saved = da.HEADS_FIRST_DEFAULT

    def grid(hf):
        return lambda: setattr(da, "HEADS_FIRST_DEFAULT", hf)

    rows += _ab(eng, shape, "attn grid S-major(A)/heads-first(B)", cases_grid, grid(False), grid(True),
                reps, max_ctx)
    da.HEADS_FIRST_DEFAULT = saved
    del eng, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-kernel", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    krows = [] if a.skip_kernel else attention_grid_order(a.reps)
    erows = []
    for shape in a.shapes.split(","):
        if shape:
            print(f"[{shape}]", flush=True)
            erows += engine_ab(shape, a.reps)
    if krows:
        print_table(krows, ["case", "A_us", "B_us", "B/A", "A_GB/s", "B_GB/s"])
    print_table(erows, ["shape", "case", "A_ms", "B_ms", "B/A"])
    path = write_result("decode_ab", {"shapes": a.shapes, "reps": a.reps, "copy_gbs": round(bw, 1),
                                      "dtype": "bf16", "block_size": BS},
                        {"attention": krows, "engine": erows})
    print("wrote", path)


if __name__ == "__main__":
    main()
