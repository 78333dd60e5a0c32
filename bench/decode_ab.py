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


def _graph_ms(fns, iters: int = 20) -> float:
    """ms per replay of fns captured in order as one CUDA graph (median)."""
    from bench.timing import cuda_time_ms

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    try:
        return cuda_time_ms(g.replay, iters=iters, warmup=3)
    finally:
        del g


def l2_diag(reps: int, layers: int = 8) -> list[dict]:
    """Does an L2-resident o_proj weight make o_proj faster, and does the attention kernel's
    prefetch get it there? Per layer: an L2 flush (256 MB copy), then the ops; µs per layer
    from differences of whole-graph times (Llama-3.1-8B o_proj, batch 1, ctx 1024)."""
    from engine.kernels.skinny_gemm import skinny_linear

    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(layers)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16)
    fa = torch.empty(128 << 20, device="cuda", dtype=torch.bfloat16)
    fb = torch.empty_like(fa)
    q, cache, bt, lens = _attn_inputs(1, 1024)

    def flush():
        fb.copy_(fa)

    def o(i):
        return lambda: skinny_linear(x, ws[i], residual=res, out=res)

    def att(i, pf):
        return lambda: da.paged_decode_attention(q, cache, bt, lens, D ** -0.5,
                                                 l2_prefetch=ws[i] if pf else None)

    seqs = {
        "flush": lambda i: [flush],
        "flush+o": lambda i: [flush, o(i)],
        "flush+o+o": lambda i: [flush, o(i), o(i)],
        "flush+attn": lambda i: [flush, att(i, False)],
        "flush+attn(pf)": lambda i: [flush, att(i, True)],
        "flush+attn+o": lambda i: [flush, att(i, False), o(i)],
        "flush+attn(pf)+o": lambda i: [flush, att(i, True), o(i)],
        "flush+attn(pf,evict_last)+o": lambda i: [flush, att(i, True), o(i)],
    }
    t = {k: [] for k in seqs}
    for _ in range(reps):
        for k, mk in seqs.items():
            da.L2PF_EVICT_LAST = "evict_last" in k
            fns = [f for i in range(layers) for f in mk(i)]
            t[k].append(_graph_ms(fns) * 1e3 / layers)
    da.L2PF_EVICT_LAST = False
    m = {k: statistics.median(v) for k, v in t.items()}
    derived = {
        "o_proj cold (L2 flushed)": m["flush+o"] - m["flush"],
        "o_proj warm (second read)": m["flush+o+o"] - m["flush+o"],
        "attn": m["flush+attn"] - m["flush"],
        "attn with prefetch issued": m["flush+attn(pf)"] - m["flush"],
        "attn+o_proj": m["flush+attn+o"] - m["flush"],
        "attn(pf)+o_proj": m["flush+attn(pf)+o"] - m["flush"],
        "attn(pf evict_last)+o_proj": m["flush+attn(pf,evict_last)+o"] - m["flush"],
    }
    rows = [{"case": f"l2 {k}", "us": round(v, 2)} for k, v in derived.items()]
    for r in rows:
        print("  ", r, flush=True)
    rows.append({"case": "l2 raw medians", "raw_us": {k: round(v, 2) for k, v in m.items()}})
    return rows


TILES = [(32, 4, 2, True), (32, 4, 3, True), (64, 4, 2, True), (64, 8, 2, True), (64, 4, 3, False),
         (128, 8, 2, True), (128, 8, 3, False), (16, 4, 3, True), (32, 2, 2, True), (64, 8, 3, False)]


def attention_tiles(cases=((64, 2048), (128, 1024), (32, 4096))) -> list[dict]:
    """Tile (block_n, warps, stages, register prefetch) then split count, per case."""
    rows = []
    for batch, ctx in cases:
        q, cache, bt, lens = _attn_inputs(batch, ctx)
        nbytes = batch * ctx * HKV * D * 2 * 2

        def run(**kw):
            fn = lambda: da.paged_decode_attention(q, cache, bt, lens, D ** -0.5, **kw)  # noqa: E731
            us = _graph_ms([fn] * 10) * 100
            r = {"case": f"attn b={batch} ctx={ctx}", "cfg": kw, "us": round(us, 2),
                 "GB/s": round(nbytes / us / 1e3)}
            rows.append(r)
            return r
        base = run()
        got = [run(block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf) for bn, nw, ns, pf in TILES]
        for r in sorted(got, key=lambda r: r["us"])[:3]:
            for sp in (1, 2, 3, 4, 6, 8):
                run(num_splits=sp, **r["cfg"])
        best = min((r for r in rows if r["case"] == base["case"]), key=lambda r: r["us"])
        print(f"   {base['case']}: default {base['us']} us ({base['GB/s']} GB/s); best {best['cfg']} "
              f"{best['us']} us ({best['GB/s']} GB/s)", flush=True)
        del q, cache, bt, lens
    return rows


SPLIT_CASES = [(1, 1024), (1, 4096), (4, 1024), (8, 1024), (8, 4096), (16, 1024), (16, 4096),
               (32, 1024), (64, 1024)]
SPLIT_TILES = [(128, 8, 3, False), (64, 4, 3, False), (32, 4, 2, True)]


def attention_splits() -> list[dict]:
    """Split count per tile for small and mid batches; each tile's output checked against
    the current default's (max abs difference)."""
    rows = []
    for batch, ctx in SPLIT_CASES:
        q, cache, bt, lens = _attn_inputs(batch, ctx)
        nbytes = batch * ctx * HKV * D * 2 * 2
        ref = da.paged_decode_attention(q, cache, bt, lens, D ** -0.5).float()
        base = _graph_ms([lambda: da.paged_decode_attention(q, cache, bt, lens, D ** -0.5)] * 10) * 100
        best = (base, "default")
        for bn, nw, ns, pf in SPLIT_TILES:
            for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                kw = dict(block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf, num_splits=sp)
                fn = lambda: da.paged_decode_attention(q, cache, bt, lens, D ** -0.5, **kw)  # noqa: E731
                err = (fn().float() - ref).abs().max().item()
                us = _graph_ms([fn] * 10) * 100
                rows.append({"case": f"attn b={batch} ctx={ctx}", "cfg": kw, "us": round(us, 2),
                             "GB/s": round(nbytes / us / 1e3), "max_err": err})
                best = min(best, (us, str(kw)))
        print(f"   b={batch} ctx={ctx}: default {base:.2f} us, best {best[0]:.2f} us {best[1]}; "
              f"max err {max(r['max_err'] for r in rows if r['case'].endswith(f'b={batch} ctx={ctx}')):.2e}",
              flush=True)
        rows.append({"case": f"attn b={batch} ctx={ctx}", "cfg": "default", "us": round(base, 2)})
        del q, cache, bt, lens
    return rows


def engine_tile_ab(shape: str, reps: int) -> list[dict]:
    max_ctx = 2048
    nb = 64 * (-(-(max_ctx + 1) // BS)) + 8
    eng = make_engine(shape, 64, max_ctx, eager=False, num_blocks=nb, prefill_graphs=False)
    saved = da.BIG_BATCH_TILE

    def tile(t):
        return lambda: setattr(da, "BIG_BATCH_TILE", t)

    rows = _ab(eng, shape, "attn big-batch tile off(A)/on(B)", [(1, 1024), (16, 1024), (32, 1024), (64, 1024), (64, 2048)],
               tile(None), tile((128, 8, 3, False)), reps, max_ctx)
    da.BIG_BATCH_TILE = saved
    del eng
    gc.collect()
    torch.cuda.empty_cache()
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
    ap.add_argument("--l2-diag", action="store_true", help="o_proj L2 residency diagnostic")
    ap.add_argument("--attn-tiles", action="store_true", help="decode attention tile/split sweep")
    ap.add_argument("--attn-splits", action="store_true", help="split count per tile, small batches")
    ap.add_argument("--tile-ab", default="", help="shapes for the engine big-batch tile A/B")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    krows = [] if a.skip_kernel else attention_grid_order(a.reps)
    drows = l2_diag(a.reps) if a.l2_diag else []
    trows = attention_tiles() if a.attn_tiles else []
    trows += attention_splits() if a.attn_splits else []
    erows = []
    for shape in a.tile_ab.split(","):
        if shape:
            print(f"[{shape}] big-batch tile", flush=True)
            erows += engine_tile_ab(shape, a.reps)
    for shape in a.shapes.split(","):
        if shape:
            print(f"[{shape}]", flush=True)
            erows += engine_ab(shape, a.reps)
    if krows:
        print_table(krows, ["case", "A_us", "B_us", "B/A", "A_GB/s", "B_GB/s"])
    if erows:
        print_table(erows, ["shape", "case", "A_ms", "B_ms", "B/A"])
    path = write_result("decode_ab", {"shapes": a.shapes, "reps": a.reps, "copy_gbs": round(bw, 1),
                                      "dtype": "bf16", "block_size": BS},
                        {"attention": krows, "engine": erows, "l2_diag": drows, "attn_tiles": trows})
    print("wrote", path)


if __name__ == "__main__":
    main()
