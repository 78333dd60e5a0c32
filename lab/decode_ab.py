"""Decode attention tuning and A/B on one GPU. Engine A/Bs interleave captures (A, B, A, B, ...)
and take medians, because re-capturing the same graph moves step times by up to 5% on the H200.

    python -m bench.decode_ab [--shapes llama-3.1-8b] [--reps 3] [--attn-tiles] [--attn-splits]
                              [--fused-ab | --attn-cost | --tile-b SPECS | --attr-b SPECS
                               | --table-ab CANDIDATE.json [--cases ...]]

--attn-tiles / --attn-splits: paged decode attention tiles (block_n, warps, stages, register
prefetch) and split counts as the step runs the kernel (the engine's cache layout, scattered
blocks, seq_len ctx + 1, the fused rotary; Llama-3.1-8B heads, --attn-head-dim 64 for 1B),
CUDA-graph timed, each output of --attn-splits checked against the default's. Engine: whole
decode steps replayed as CUDA graphs (random bf16 weights), the previous 16-bit attention tile
(A) vs the current default (B).
--fused-ab: whole decode steps at 24-64 rows, cuBLAS matmuls (A: the fused skinny path only up
to 16 rows) vs the fused path up to 64 rows (B: each op our kernel or cuBLAS, as the tuned
table says).
--tile-b: whole decode steps, the default 16-bit decode attention tile (A) vs each given tile
(the batch tiles off on both sides).
--attr-b: whole decode steps, a module-level switch at its current value (A) vs the given one
(B), e.g. --attr-b "engine.kernels.rmsnorm.PDL=False"; SPECS separated by ';' are separate
A/Bs, and one spec may set several attributes joined by '&' (a candidate skinny table with
other switches: engine.kernels.skinny_configs.CONFIG_DIR='DIR' holding skinny_gemm-<gpu>.json;
a dataclass attribute takes a dict of the fields to change, e.g.
engine.kernels.decode_tiles.TILE_16BIT={'block_n': 32, 'num_warps': 4}).
--attn-cost: diagnostic, whole decode steps with attention (A) vs with the attention call
skipped (B), i.e. what attention costs inside a step, for the cases of --cases.
--table-ab: whole decode steps with the shipped tuned skinny-GEMM table (A) vs a candidate
table (B, e.g. `bench.skinny_gemm_sweep --write-table --table-out F`): the step-level check
of a table change, since isolated matmul timings miss launch overlap (PDL) and L2 effects.
Prints tables and writes bench/results/decode_ab-*.json.

Also measured with this script on 2026-12-03 (H200) and dropped, both within noise or worse
(bench/results/decode_ab-20261203T002416, -T023036): a heads-first grid order (Hkv, S,
splits) for the decode kernel (+-0.5%), and an L2 bulk prefetch (cp.async.bulk.prefetch.L2)
of o_proj's weight issued by the attention kernel before its grid-dependency wait (8B batch
1: +1.3% step time; micro: o_proj 13.3 us from DRAM, still 8.7 us from L2, and the
prefetch slowed attention by 3.3 us). And on 2026-12-03 later: the split results merged by
the last split to finish instead of the reduce kernel (-T061429; 8B batch 1 +8% / +4.5% at
ctx 1024 / 4096, batches 4-16 0.7-1.1% faster, noise), and (-T074351) each split's first
K/V tile loaded before the PDL wait, the new token's row patched in after it (8B: batch 1
-0.5% / +1.7% at ctx 1024 / 4096, batch 8 +4.3%, batch 64 +1.1%). And (-T082351, run with
`bash lab/gpu_session.sh variants`) an L2 bulk prefetch window in the one-row skinny
matmuls, issued by the matmul's own programs: 8B batch 1 o_proj / qkv within noise, gate_up
and down +4-6% each, all four +8-9%. Sixth session (--attr-b, 8B batch 1): the rmsnorm kernel
on PDL +10% (-T124409), every kernel triggering its dependent late +6% (-T125629), cuts in the
PDL chain before o_proj / the reduce / qkv +0.2-1.9% (-T132155); small attention tiles at batch
1 -1.4..+4% (-T124610); rotary fused at 16-64 sequences -1.4..-0.2% (-T130640, shipped).
Eighth session (8B, medians of 5, -T153107): at batches 4-16 the reduce kernel without PDL
-0.4..+4.2%, and half the splits (TILE_16BIT programs_per_sm 1) +0.5..+8%.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics

import torch

import engine.kernels.decode_attention as da
import engine.kernels.decode_tiles as dt
import engine.kernels.trace as trace
from bench.common import parse_attrs, print_table, write_result
from bench.engine_gpu_steps import make_engine, time_decode
from bench.timing import copy_bandwidth_gbs, graph_time_ms

HQ, HKV, D, BS = 32, 8, 128, 16


def _attn_inputs(batch: int, ctx: int, device="cuda", hq: int = HQ, hkv: int = HKV, d: int | None = None):
    """A decode step's attention inputs as the engine has them: the engine's per-layer cache
    layout [2, blocks, BS, Hkv, D], `ctx` cached tokens plus the new one (seq_len ctx + 1)
    on scattered blocks, and the fused rotary + KV append (new_kv) the step uses.
    (Before 2026-12-03 this took a [blocks, 2, ...] cache, which the kernel addresses as
    [2, ...]: K and V reads then overlapped in memory, half the bytes came from L2, and b=64
    ctx=2048 timed 117 us where the engine's layout takes 131.5; attn_gap in the README.
    tests/kernels/test_bench_attn_inputs.py checks the kernel on these inputs against the reference.)"""
    d = D if d is None else d
    n = ctx + 1
    nblk = -(-n // BS)
    cache = torch.randn(2, batch * nblk + 1, BS, hkv, d, device=device, dtype=torch.bfloat16)
    bt = torch.randperm(batch * nblk, device=device, dtype=torch.int64).to(torch.int32).view(batch, nblk)
    lens = torch.full((batch,), n, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(n, d // 2, device=device) for _ in range(2))
    idx = torch.full((batch,), n - 1, device=device, dtype=torch.int64)
    slots = bt[:, (n - 1) // BS].long() * BS + (n - 1) % BS
    return q, cache, bt, lens, (k, v, cos, sin, idx, slots)


TILES = [(32, 4, 2, True), (32, 4, 3, True), (64, 4, 2, True), (64, 8, 2, True), (64, 4, 3, False),
         (128, 8, 2, True), (128, 8, 3, False), (16, 4, 3, True), (32, 2, 2, True), (64, 8, 3, False),
         (64, 4, 2, False), (64, 4, 4, False), (64, 2, 2, False), (32, 2, 2, False), (128, 4, 2, False)]


def attention_tiles(cases=((64, 2048), (48, 2048), (128, 1024), (32, 4096)), d: int = D) -> list[dict]:
    """Tile (block_n, warps, stages, register prefetch) then split count, per case; head_dim d."""
    rows = []
    for batch, ctx in cases:
        q, cache, bt, lens, new_kv = _attn_inputs(batch, ctx, d=d)
        nbytes = batch * (ctx + 1) * HKV * d * 2 * 2

        def run(**kw):
            fn = lambda: da.paged_decode_attention(q, cache, bt, lens, d ** -0.5, new_kv=new_kv, **kw)  # noqa: E731
            us = graph_time_ms([fn] * 10, iters=20) * 1e3
            r = {"case": f"attn b={batch} ctx={ctx}" + (f" d={d}" if d != D else ""), "cfg": kw,
                 "us": round(us, 2), "GB/s": round(nbytes / us / 1e3)}
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
        del q, cache, bt, lens, new_kv
    return rows


SPLIT_CASES = [(1, 1024), (1, 4096), (4, 1024), (8, 1024), (8, 4096), (16, 1024), (16, 4096),
               (32, 1024), (64, 1024)]
SPLIT_TILES = [(128, 8, 3, False), (64, 4, 3, False), (32, 4, 2, True)]


def attention_splits(d: int = D) -> list[dict]:
    """Split count per tile for small and mid batches; each tile's output checked against
    the current default's (max abs difference)."""
    rows = []
    for batch, ctx in SPLIT_CASES:
        q, cache, bt, lens, new_kv = _attn_inputs(batch, ctx, d=d)
        nbytes = batch * (ctx + 1) * HKV * d * 2 * 2
        ref = da.paged_decode_attention(q, cache, bt, lens, d ** -0.5, new_kv=new_kv).float()
        base = graph_time_ms([lambda: da.paged_decode_attention(q, cache, bt, lens, d ** -0.5, new_kv=new_kv)]
                             * 10, iters=20) * 1e3
        best = (base, "default")
        for bn, nw, ns, pf in SPLIT_TILES:
            for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                kw = dict(block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf, num_splits=sp)
                fn = lambda: da.paged_decode_attention(q, cache, bt, lens, d ** -0.5, new_kv=new_kv, **kw)  # noqa: E731
                err = (fn().float() - ref).abs().max().item()
                us = graph_time_ms([fn] * 10, iters=20) * 1e3
                rows.append({"case": f"attn b={batch} ctx={ctx}", "cfg": kw, "us": round(us, 2),
                             "GB/s": round(nbytes / us / 1e3), "max_err": err})
                best = min(best, (us, str(kw)))
        print(f"   b={batch} ctx={ctx}: default {base:.2f} us, best {best[0]:.2f} us {best[1]}; "
              f"max err {max(r['max_err'] for r in rows if r['case'].endswith(f'b={batch} ctx={ctx}')):.2e}",
              flush=True)
        rows.append({"case": f"attn b={batch} ctx={ctx}", "cfg": "default", "us": round(base, 2)})
        del q, cache, bt, lens, new_kv
    return rows


# the 16-bit tile before 2026-12-03; its split rule then rounded programs_per_sm x SMs / pairs
# up (ceil) where the current rule rounds down, a difference of at most one split
OLD_TILE = dt.DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4)


def engine_tile_ab(shape: str, reps: int, tile_a=OLD_TILE, tile_b=None, name="attn tile old(A)/new(B)",
                   cases=((1, 1024), (8, 1024), (16, 1024), (32, 1024), (64, 1024), (64, 2048))
                   ) -> list[dict]:
    """Whole decode steps: the 16-bit decode attention tile tile_a (default: the tile before
    2026-12-03) vs tile_b (default: the current one), at every batch: the batch tiles are off
    on both sides, else batches that fill the default tile's wave would run the same tile."""
    new, batch_tile = dt.TILE_16BIT, dt.BATCH_TILE

    def tile(t):
        def use(_eng):
            dt.TILE_16BIT, dt.BATCH_TILE = t, False
        return use

    try:
        return _ab(shape, name, cases, tile(tile_a), tile(tile_b or new), reps)
    finally:
        dt.TILE_16BIT, dt.BATCH_TILE = new, batch_tile


def parse_tile(spec: str) -> dt.DecodeTile:
    """'128,8,3,0,2,1' -> DecodeTile(block_n, warps, stages, prefetch, programs_per_sm,
    min_tiles_per_split)."""
    v = [int(x) for x in spec.split(",")]
    if len(v) != 6:
        raise SystemExit(f"--tile-b {spec!r}: want BN,WARPS,STAGES,PREFETCH,PPS,MIN_TILES")
    return dt.DecodeTile(v[0], v[1], v[2], bool(v[3]), programs_per_sm=v[4], min_tiles_per_split=v[5])


def engine_attn_cost_ab(shape: str, reps: int, cases) -> list[dict]:
    """Diagnostic, not a correct model: whole decode steps with attention (A) vs with the
    attention call returning q unchanged (B: no attention kernels at all), so A - B is what
    attention costs inside a step (launch seams and PDL overlap included), to set against
    its isolated kernel time."""
    from engine.layers.attention_triton import TritonAttentionBackend as T
    orig = T.forward_rope

    def skip(self, layer, q, k, v, rope, kv_cache, meta, kv_scales=None):
        return q

    def use(fn):
        return lambda _eng: setattr(T, "forward_rope", fn)

    try:
        return _ab(shape, "attention(A)/none(B)", cases, use(orig), use(skip), reps)
    finally:
        T.forward_rope = orig


def engine_fused_ab(shape: str, reps: int) -> list[dict]:
    """Whole decode steps: fused path up to 16 rows, cuBLAS above (A) vs fused up to 64 (B)."""
    def rows(max_m):
        def set_rows(eng):
            eng.runner.model.skinny_max_m, eng.runner.model.skinny_rows = max_m, None
        return set_rows

    cases = [(24, 1024), (32, 1024), (48, 2048), (64, 1024), (64, 2048)]
    return _ab(shape, "matmuls cuBLAS(A)/fused(B)", cases, rows(16), rows(64), reps)


def engine_table_ab(shape: str, reps: int, candidate: str, cases) -> list[dict]:
    """Whole decode steps: the shipped skinny-GEMM table (A) vs the candidate table file (B);
    the model's fused-path batch sizes stay those of the shipped table."""
    import engine.kernels.skinny_configs as sc

    shipped = sc.table_path

    def table(path_fn):
        def use(_eng=None):
            sc.table_path = path_fn
            sc.forget_cached()
        return use

    try:
        return _ab(shape, "skinny table shipped(A)/candidate(B)", cases, table(shipped),
                   table(lambda _name: candidate), reps)
    finally:
        table(shipped)()


def engine_attr_ab(shape: str, reps: int, spec: str, cases) -> list[dict]:
    """Whole decode steps: module attributes at their current values (A) vs set as in spec (B)."""
    sets = parse_attrs(spec)
    orig = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in sets]

    def assign(pairs):
        def use(_eng=None):
            import engine.kernels.skinny_configs as sc

            for mod, attr, value in pairs:
                setattr(mod, attr, value)
            # a switch of skinny_configs.CONFIG_DIR (a directory holding a candidate
            # skinny_gemm-<gpu>.json) takes effect now
            sc.forget_cached()
        return use

    try:
        return _ab(shape, f"attr default(A)/{spec}(B)", cases, assign(orig), assign(sets), reps)
    finally:
        assign(orig)()


def _ab(shape: str, name: str, cases, set_a, set_b, reps: int) -> list[dict]:
    """One engine sized for `cases` (batch, ctx); per rep, set_a(eng) then set_b(eng), each
    followed by a graph re-capture and a timed step per case; medians per side. The step is
    the staged graph's replay (time_decode's replay_ms: GPU time, no host staging, whose
    jitter made A/Bs before 2026-12-03 19:20 bimodal by ~3%)."""
    cases = list(cases)
    max_ctx = max(c for _, c in cases)
    max_b = max(b for b, _ in cases)
    eng = make_engine(shape, max_b, max_ctx, eager=False,
                      num_blocks=max_b * (-(-(max_ctx + 1) // BS)) + 8, prefill_graphs=False)
    t = {c: {"A": [], "B": []} for c in cases}
    try:
        for _ in range(reps):
            for side, setter in (("A", set_a), ("B", set_b)):
                setter(eng)
                if trace.ENABLED:  # a switch may trace (timing what stamps cost): fresh arena slices
                    trace.reset()
                eng.runner.maybe_capture_graphs(eng.max_model_len, eng.runner.model.attn_backend.name)
                for b, c in cases:
                    td = time_decode(eng, b, c, eager=False)
                    t[(b, c)][side].append(td.get("replay_ms", td["graph_ms"]))
    finally:
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    for (b, c), s in t.items():
        a, bb = statistics.median(s["A"]), statistics.median(s["B"])
        rows.append({"shape": shape, "case": f"{name} b={b} ctx={c}", "A_ms": round(a, 4),
                     "B_ms": round(bb, 4), "B/A": round(bb / a, 4), "samples": s})
        print("  ", {k: v for k, v in rows[-1].items() if k != "samples"}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.1-8b",
                    help="shapes for the engine A/B of the attention tile ('' to skip)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attn-tiles", action="store_true", help="tile sweep, batches 32-128")
    ap.add_argument("--attn-splits", action="store_true", help="split count per tile, batches 1-64")
    ap.add_argument("--attn-cases", default="64:2048,48:2048,128:1024,32:4096",
                    help="batch:ctx cases of --attn-tiles")
    ap.add_argument("--attn-head-dim", type=int, default=128,
                    help="head_dim of --attn-tiles / --attn-splits (128: Llama-3.1-8B, 64: Llama-3.2-1B)")
    ap.add_argument("--fused-ab", action="store_true",
                    help="engine A/B of the matmul path at 32-64 rows instead of the tile A/B")
    ap.add_argument("--table-ab", default=None, metavar="CANDIDATE.json[,...]",
                    help="engine A/B of the shipped skinny-GEMM table vs each of these instead")
    ap.add_argument("--tile-b", default=None, metavar="BN,WARPS,STAGES,PREFETCH,PPS,MIN_TILES;...",
                    help="engine A/B of the default 16-bit decode attention tile vs each of these")
    ap.add_argument("--attr-b", default=None, metavar="MODULE.NAME=VALUE[&...];...",
                    help="engine A/B of module switches at their defaults vs these values")
    ap.add_argument("--attn-cost", action="store_true",
                    help="diagnostic engine A/B: steps with vs without attention (--cases)")
    ap.add_argument("--cases", default="1:1024,8:1024,16:1024,64:2048",
                    help="batch:ctx cases of --table-ab / --tile-b / --attr-b")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    attn_cases = [tuple(int(v) for v in c.split(":")) for c in a.attn_cases.split(",")]
    trows = attention_tiles(attn_cases, a.attn_head_dim) if a.attn_tiles else []
    trows += attention_splits(a.attn_head_dim) if a.attn_splits else []
    erows = []
    for shape in a.shapes.split(","):
        if shape:
            cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")]
            if a.table_ab:
                for cand in a.table_ab.split(","):
                    print(f"[{shape}] skinny table A/B: {cand}", flush=True)
                    erows += engine_table_ab(shape, a.reps, cand, cases)
                continue
            if a.attr_b:
                for spec in a.attr_b.split(";"):
                    print(f"[{shape}] switch A/B: default vs {spec}", flush=True)
                    erows += engine_attr_ab(shape, a.reps, spec, cases)
                continue
            if a.attn_cost:
                print(f"[{shape}] attention cost in the step (A/B without it)", flush=True)
                erows += engine_attn_cost_ab(shape, a.reps, cases)
                continue
            if a.tile_b:
                for spec in a.tile_b.split(";"):
                    tile = parse_tile(spec)
                    print(f"[{shape}] attention tile A/B: default vs {tile}", flush=True)
                    erows += engine_tile_ab(shape, a.reps, dt.TILE_16BIT, tile,
                                            f"attn tile default(A)/{spec}(B)", cases)
                continue
            print(f"[{shape}] {'matmul path' if a.fused_ab else 'attention tile'} A/B", flush=True)
            erows += (engine_fused_ab if a.fused_ab else engine_tile_ab)(shape, a.reps)
    if erows:
        print_table(erows, ["shape", "case", "A_ms", "B_ms", "B/A"])
    path = write_result("decode_ab", {"shapes": a.shapes, "reps": a.reps, "fused_ab": a.fused_ab,
                                      "table_ab": a.table_ab, "tile_b": a.tile_b, "attr_b": a.attr_b, "attn_cost": a.attn_cost,
                                      "cases": a.cases if a.table_ab or a.tile_b or a.attr_b or a.attn_cost else None, "copy_gbs": round(bw, 1), "attn_head_dim": a.attn_head_dim,
                                      "dtype": "bf16", "block_size": BS},
                        {"engine": erows, "attn_tiles": trows})
    print("wrote", path)


if __name__ == "__main__":
    main()
