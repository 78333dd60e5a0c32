"""Decode attention tuning and A/B on one GPU. Engine A/Bs build one engine per side (each with
its KernelOptions), interleave their captures (A, B, A, B, ...) and take medians, because
re-capturing the same graph moves step times by up to 5% on the H200.

    python -m lab.decode_ab [--shapes llama-3.1-8b] [--reps 3] [--attn-tiles] [--attn-splits]
                            [--fused-ab | --attn-cost | --kernel-options-b SPECS
                             | --table-ab CANDIDATE.json[,...]] [--kernel-options-a SPEC]
                            [--cases 1:1024,...]

--attn-tiles / --attn-splits: paged decode attention tiles (block_n, warps, stages, register
prefetch) and split counts as the step runs the kernel (the engine's cache layout, scattered
blocks, seq_len ctx + 1, the fused rotary; Llama-3.1-8B heads, --attn-head-dim 64 for 1B),
CUDA-graph timed, each output of --attn-splits checked against the default's. Engine: whole
decode steps replayed as CUDA graphs (random bf16 weights), the previous 16-bit attention tile
(A) vs the current default (B).
--fused-ab: whole decode steps at 24-64 rows, cuBLAS matmuls (A: the fused skinny path only up
to 16 rows) vs the fused path up to 64 rows (B: each op our kernel or cuBLAS, as the tuned
table says).
--kernel-options-b: whole decode steps, the engine on KernelOptions A (--kernel-options-a,
default: the defaults) vs A with SPEC applied (B), e.g. --kernel-options-b 'pdl_rmsnorm=True';
SPECS separated by ';' are separate A/Bs; a SPEC is NAME=VALUE[,NAME=VALUE...] of
engine/kernels/options.py's fields (bench.common.kernel_options), e.g. a decode attention tile
at every batch: "tile_16bit={'block_n': 32, 'num_warps': 4},batch_tile=False,few_tile=False".
--attn-cost: diagnostic, whole decode steps with attention (A) vs with the attention call
skipped (B), i.e. what attention costs inside a step, for the cases of --cases.
--table-ab: whole decode steps with the shipped tuned skinny-GEMM table (A) vs a candidate
table (B: KernelOptions.skinny_table, e.g. from `lab.skinny_gemm_sweep --write-table
--table-out F`): the step-level check of a table change, since isolated matmul timings miss
launch overlap (PDL) and L2 effects; each side takes its table's fused-path batch sizes.
Prints tables and writes lab/results/decode_ab-*.json. Past runs: lab/notes/kernels.md.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
from dataclasses import replace

import torch

import engine.kernels.decode_attention as da
import engine.kernels.decode_tiles as dt
import engine.kernels.trace as trace
from bench.common import kernel_options, print_table, with_kernels, write_result
from bench.engine_gpu_steps import make_engine, time_decode
from bench.timing import copy_bandwidth_gbs, graph_time_ms
from engine.kernels.options import KernelOptions

HQ, HKV, D, BS = 32, 8, 128, 16


def _attn_inputs(batch: int, ctx: int, device="cuda", hq: int = HQ, hkv: int = HKV, d: int | None = None):
    """A decode step's attention inputs as the engine has them: the engine's per-layer cache
    layout [2, blocks, BS, Hkv, D], `ctx` cached tokens plus the new one (seq_len ctx + 1)
    on scattered blocks, and the fused rotary + KV append (new_kv) the step uses.
    (tests/lab/test_decode_ab_inputs.py checks the kernel on these inputs against the reference.)"""
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


# the 16-bit tile before the 128-token one (lab/notes/kernels.md); its split rule then rounded
# programs_per_sm x SMs / pairs up (ceil) where the current rule rounds down (<= one split apart)
OLD_TILE = dt.DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4)
# the small-batch tile at every batch: neither the batch nor the few-sequence tile takes over
EVERY_BATCH = KernelOptions(batch_tile=False, few_tile=False)


def engine_tile_ab(shape: str, reps: int, tile_a=OLD_TILE, tile_b=dt.TILE_16BIT,
                   name="attn tile old(A)/new(B)",
                   cases=((1, 1024), (8, 1024), (16, 1024), (32, 1024), (64, 1024), (64, 2048))
                   ) -> list[dict]:
    """Whole decode steps: the 16-bit decode attention tile tile_a (default: the tile before
    the 128-token one) vs tile_b (default: the current one), each run at every batch."""
    return _ab(shape, name, cases, reps, (replace(EVERY_BATCH, tile_16bit=tile_a),
                                          replace(EVERY_BATCH, tile_16bit=tile_b)))


def engine_attn_cost_ab(shape: str, reps: int, cases) -> list[dict]:
    """Diagnostic, not a correct model: whole decode steps with attention (A) vs with the
    attention call returning q unchanged (B: no attention kernels at all), so A - B is what
    attention costs inside a step (launch seams and PDL overlap included), to set against
    its isolated kernel time. B overrides forward_rope on the engine's backend object only."""
    def skip(layer, q, k, v, rope, kv_cache, meta, kv_scales=None):
        return q

    def attend(on):
        def use(eng):
            be = eng.runner.model.attn_backend
            if on:
                be.__dict__.pop("forward_rope", None)  # the class's method again
            else:
                be.forward_rope = skip
        return use

    return _ab(shape, "attention(A)/none(B)", cases, reps, setters=(attend(True), attend(False)))


def engine_fused_ab(shape: str, reps: int) -> list[dict]:
    """Whole decode steps: fused path up to 16 rows, cuBLAS above (A) vs fused up to 64 (B)."""
    def rows(max_m):
        def set_rows(eng):
            eng.runner.model.skinny_max_m, eng.runner.model.skinny_rows = max_m, None
        return set_rows

    cases = [(24, 1024), (32, 1024), (48, 2048), (64, 1024), (64, 2048)]
    return _ab(shape, "matmuls cuBLAS(A)/fused(B)", cases, reps, setters=(rows(16), rows(64)))


def engine_table_ab(shape: str, reps: int, candidate: str, cases, base: KernelOptions) -> list[dict]:
    """Whole decode steps: the shipped skinny-GEMM table (A) vs the candidate table file (B)."""
    return _ab(shape, "skinny table shipped(A)/candidate(B)", cases, reps,
               (base, replace(base, skinny_table=candidate)))


def engine_kernels_ab(shape: str, reps: int, base: KernelOptions, spec: str, cases) -> list[dict]:
    """Whole decode steps: the engine on KernelOptions base (A) vs base with spec applied (B)."""
    return _ab(shape, f"kernels A/{spec}(B)", cases, reps, (base, kernel_options(spec, base)))


def _ab(shape: str, name: str, cases, reps: int, kernels=(KernelOptions(), KernelOptions()),
        setters=(None, None)) -> list[dict]:
    """One engine per KernelOptions side (one for both when equal) sized for `cases` (batch,
    ctx); per rep, side A then side B: its setter(eng) if any, a graph re-capture and a timed
    step per case; medians per side. The step is the staged graph's replay (time_decode's
    replay_ms: GPU time, without the host staging's jitter)."""
    cases = list(cases)
    max_ctx = max(c for _, c in cases)
    max_b = max(b for b, _ in cases)
    first = make_engine(shape, max_b, max_ctx, eager=False,
                        num_blocks=max_b * (-(-(max_ctx + 1) // BS)) + 8, prefill_graphs=False)
    eng_a = with_kernels(first, kernels[0])
    del first  # freed here when side A runs other options
    eng_b = with_kernels(eng_a, kernels[1])
    t = {c: {"A": [], "B": []} for c in cases}
    try:
        for _ in range(reps):
            for side, eng, setter in (("A", eng_a, setters[0]), ("B", eng_b, setters[1])):
                if setter is not None:
                    setter(eng)
                if eng.cfg.kernels.trace:  # timing what the stamps cost: fresh arena slices
                    trace.reset()
                eng.runner.maybe_capture_graphs(eng.max_model_len, eng.runner.model.attn_backend.name)
                for b, c in cases:
                    td = time_decode(eng, b, c, eager=False)
                    t[(b, c)][side].append(td.get("replay_ms", td["graph_ms"]))
    finally:
        eng_a = eng_b = eng = None
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
    ap.add_argument("--kernel-options-a", default="", metavar="NAME=VALUE[,...]",
                    help="KernelOptions of side A (and the base of B) of --kernel-options-b / --table-ab")
    ap.add_argument("--kernel-options-b", default=None, metavar="NAME=VALUE[,...][;...]",
                    help="engine A/B of KernelOptions A vs A with each of these applied")
    ap.add_argument("--attn-cost", action="store_true",
                    help="diagnostic engine A/B: steps with vs without attention (--cases)")
    ap.add_argument("--cases", default="1:1024,8:1024,16:1024,64:2048",
                    help="batch:ctx cases of --table-ab / --kernel-options-b / --attn-cost")
    a = ap.parse_args()
    try:  # every spec checked before any GPU work
        base = kernel_options(a.kernel_options_a)
        for spec in (a.kernel_options_b or "").split(";"):
            kernel_options(spec, base)
    except ValueError as e:
        ap.error(str(e))
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
                    erows += engine_table_ab(shape, a.reps, cand, cases, base)
                continue
            if a.kernel_options_b:
                for spec in a.kernel_options_b.split(";"):
                    print(f"[{shape}] kernel options A/B: {a.kernel_options_a or 'defaults'} vs {spec}",
                          flush=True)
                    erows += engine_kernels_ab(shape, a.reps, base, spec, cases)
                continue
            if a.attn_cost:
                print(f"[{shape}] attention cost in the step (A/B without it)", flush=True)
                erows += engine_attn_cost_ab(shape, a.reps, cases)
                continue
            print(f"[{shape}] {'matmul path' if a.fused_ab else 'attention tile'} A/B", flush=True)
            erows += (engine_fused_ab if a.fused_ab else engine_tile_ab)(shape, a.reps)
    if erows:
        print_table(erows, ["shape", "case", "A_ms", "B_ms", "B/A"])
    engine_ab = a.table_ab or a.kernel_options_b or a.attn_cost
    path = write_result("decode_ab", {"shapes": a.shapes, "reps": a.reps, "fused_ab": a.fused_ab,
                                      "table_ab": a.table_ab, "kernel_options_a": a.kernel_options_a,
                                      "kernel_options_b": a.kernel_options_b, "attn_cost": a.attn_cost,
                                      "cases": a.cases if engine_ab else None, "copy_gbs": round(bw, 1),
                                      "attn_head_dim": a.attn_head_dim, "dtype": "bf16", "block_size": BS},
                        {"engine": erows, "attn_tiles": trows})
    print("wrote", path)


if __name__ == "__main__":
    main()
