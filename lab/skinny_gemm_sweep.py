"""Skinny decode GEMM sweep on one GPU: the exact fused matmuls of a decode step (norm+qkv,
o_proj+residual, norm+gate_up+silu, down+residual, lm_head->fp32) for Llama-3.2-1B and
Llama-3.1-8B shapes, every candidate tile config (split-K included) vs cuBLAS, M = 1..64 rows.

    python -m lab.skinny_gemm_sweep [--m 1,16,64] [--shapes ...] [--ops qkv,o_proj]
                                    [--only slab] [--write-table [--table-out F]]

Timing: each case is captured as a CUDA graph of R launches cycling over enough weight
copies to defeat the L2 (>= 512 MB per case); replayed, CUDA events, median / R.
Bandwidth: weight + activation bytes read and outputs written, over the time.
cuBLAS baseline: the unfused ops the fused kernel replaces (our Triton rmsnorm where the
kernel fuses a norm, F.linear, silu*mul where it fuses silu, the residual add), run through
skinny_linear's CUBLAS route, which is what the engine runs for an op whose table entry is
["cublas"] (chosen where it beats our best tile by OP_MARGIN).
Ceiling measured in the same run: a pure read (sum over 1 GiB).
--write-table writes the winners to engine/kernels/configs/skinny_gemm-<gpu>.json (the
engine's tuned table, engine/kernels/skinny_configs.py) with fused_m = the tuned M whose
fused step total beats cuBLAS's on every shape (with a 5% margin; the engine uses the fused
path for a batch whose tuned bucket, the smallest tuned M >= its rows, is in fused_m).
NOTE: an isolated win can lose inside a whole step (launch overlap, L2), so the merged table
overwrites entries a step A/B may reject: sweep into a candidate (--table-out, or `bash
lab/gpu_session.sh candidate`, which also runs `lab.decode_ab --table-ab` on it) and ship only
the entries that win in whole steps. The shipped entry of each (shape, M) is always a
candidate, so a sweep never picks a tile slower than the current one. Past sweeps and the
variants they rejected: lab/notes/kernels.md.
"""
from __future__ import annotations

import argparse
import json
import os
import torch
import triton

from bench.common import print_table, write_result
from bench.timing import graph_time_ms, l2_defeating_copies
from engine.kernels.rmsnorm import rms_norm
from engine.kernels.skinny_configs import CUBLAS, SkinnyConfig, lookup, table_path
from engine.kernels.skinny_gemm import skinny_linear
from engine.kernels.slab_gemv import MAX_K as SLAB_MAX_K

SHAPES = {  # name: (hidden, q_size, q+2kv, intermediate, vocab)
    "llama-3.2-1b": (2048, 2048, 2048 + 2 * 512, 8192, 128256),
    "llama-3.1-8b": (4096, 4096, 4096 + 2 * 1024, 14336, 128256),
}
LAYERS = {"llama-3.2-1b": 16, "llama-3.1-8b": 32}


def step_us(rows: list[dict], key: str) -> float:
    """Matmul time of a whole decode step: the 4 per-layer ops x layers + lm_head."""
    return sum(r[key] * (1 if r["op"] == "lm_head" else LAYERS[r["shape"]]) for r in rows)
SMEM_LIMIT = 200 * 1024
# The fused path must beat cuBLAS's matmul total by this factor to be chosen: inside a real
# step (attention between the matmuls, PDL overlap, rmsnorm launches with norm_separate) a
# 3% matmul win at 64 rows turned into a 5% step loss on the H200 (bench/engine_gpu.py).
FUSED_MARGIN = 1.05
# Per op inside the fused path: the same op on cuBLAS (skinny_linear with the CUBLAS config:
# rmsnorm kernel, F.linear, torch epilogues) only where it is faster than our best tile by
# this factor (table entry ["cublas"]): its extra launches do not overlap their neighbours
# (no PDL), which an isolated timing does not show (a 0.4% isolated win would put the 8B
# gate_up at one row on cuBLAS: 4 launches instead of 1).
OP_MARGIN = 1.03


def ops(shape: str):
    h, q, qkv, i, v = SHAPES[shape]
    # (name, N_out, K, norm, silu, resid, fp32 out)
    return [("norm+qkv", qkv, h, True, False, False, False),
            ("o_proj+res", h, q, False, False, True, False),
            ("norm+gate_up+silu", i, h, True, True, False, False),
            ("down+res", h, i, False, False, True, False),
            ("lm_head", v, h, False, False, False, True)]


def graph_time_us(fns) -> float:
    """us per callable of one CUDA graph holding `fns` (bench/timing.py)."""
    return graph_time_ms(fns) * 1e3


def read_gbs() -> float:
    x = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    us = graph_time_us([lambda: x.sum(dtype=torch.float32)] * 4)
    return x.numel() * 2 / us / 1e3


def _split_for(n_tiles: int, sms: int) -> int:
    """The smallest power-of-2 split-K (<= 16) with n_tiles x splits >= one program per SM."""
    s = 1
    while n_tiles * s < sms and s < 16:
        s *= 2
    return s


def candidates(m: int, n: int, k: int, norm: bool, silu: bool) -> list[SkinnyConfig]:
    """FMA tiles for a few rows; tensor-core tiles with split-K chosen so that N tiles x
    splits reaches one and two programs per SM; x prefetch variants where a norm is fused."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    if m <= 8:
        fma = {1: [(4, 1024, 8), (4, 512, 4), (8, 512, 4), (8, 1024, 8), (2, 1024, 8)],
               2: [(2, 1024, 8), (4, 512, 8), (4, 1024, 8), (8, 512, 8)],
               4: [(2, 512, 8), (4, 256, 8), (4, 512, 8), (2, 256, 4)],
               8: [(2, 256, 8), (4, 128, 8), (2, 128, 4), (4, 256, 8)]}[triton.next_power_of_2(m)]
        for bn, bk, w in fma:
            for st in ((1, 3) if m == 1 else (1,)):
                out.append(SkinnyConfig(bn, bk, w, st, False))
        if m == 1:  # a whole row (or half) per load: every weight byte requested at once,
            # before the PDL wait, instead of a K loop of round trips
            out += [SkinnyConfig(bn, bk, w, 1, False) for bn, bk, w in
                    ((1, 4096, 4), (2, 4096, 8), (4, 4096, 8), (2, 2048, 4), (4, 2048, 8))
                    if bk <= k and k % bk == 0]
        for bn, bk, w in fma[:2]:
            out.append(SkinnyConfig(bn, bk, w, 1, False, 1, True))
        if m == 1 and norm:  # whole-row tiles with the norm as its own rmsnorm kernel: the
            # fused prologue's registers cost more than the launch (the 8B gate_up)
            out += [SkinnyConfig(bn, bk, w, 1, False, 1, False, True) for bn, bk, w in
                    ((2, 4096, 8), (4, 4096, 8), (2, 2048, 8), (4, 2048, 8))
                    if bk <= k and k % bk == 0]
        if m == 1:  # the dot path still wins lm_head and down at one row
            return out + [SkinnyConfig(64, 128, 4, st, True) for st in (3, 4)] + [
                SkinnyConfig(64, 256, 4, 3, True, sk) for sk in (2, 4)] + slab_candidates(k, norm)
    for bn in (32, 64):
        s1 = _split_for(-(-n // bn), sms)
        for bk in (128, 256):
            for split in sorted({1, s1, 2 * s1}):
                if -(-k // bk) < 2 * split:  # at least 2 K chunks per split
                    continue
                variants = [(3, False, False), (4, False, False)]
                if norm:
                    variants += [(3, True, False)] if m <= 32 else []
                    variants += [(3, False, True)] if m >= 16 else []
                for st, px, sep in variants:
                    c = SkinnyConfig(bn, bk, 4, st, True, split, px, sep)
                    if c.smem_bytes(m, silu) <= SMEM_LIMIT:
                        out.append(c)
    if m >= 32:  # many rows: wider/narrower tiles, 8 warps, shallower/deeper pipelines
        for bn, bk, w, st in ((16, 128, 4, 4), (16, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3),
                              (64, 128, 8, 3), (64, 64, 4, 5), (32, 64, 4, 6), (32, 128, 4, 2)):
            for sep in ((False, True) if norm else (False,)):
                c = SkinnyConfig(bn, bk, w, st, True, 1, False, sep)
                if c.smem_bytes(m, silu) <= SMEM_LIMIT:
                    out.append(c)
    return out


def slab_candidates(k: int, norm: bool) -> list[SkinnyConfig]:
    """One-row slab GEMVs (engine/kernels/slab_gemv.py): (rows a step, warps, programs per SM).
    A program holds R whole rows twice (double buffering) in registers, so wide rows take
    fewer rows a step and fewer programs per SM (more than fit would run a second wave)."""
    if k > SLAB_MAX_K:
        return []
    if k > 8192:
        grid = [(1, 8, 1), (1, 8, 2), (2, 8, 1), (1, 16, 1), (2, 16, 1)]
    else:
        grid = [(r, 8, p) for r in (1, 2, 4) for p in (2, 3, 4)] + [(1, 4, 4), (1, 4, 8), (2, 4, 4)]
    bk = min(4096, k & -k)  # the tile kernel's chunk where the entry meets more rows
    out = [SkinnyConfig(r, bk, w, 1, False, slab=p) for r, w, p in grid]
    if norm:  # the norm as its own kernel, for a few
        out += [SkinnyConfig(r, bk, w, 1, False, norm_separate=True, slab=p) for r, w, p in grid[::3]]
    return out


def cfg_name(c: SkinnyConfig) -> str:
    if c.slab:
        return f"slab r{c.block_n} w{c.num_warps} p{c.slab}" + (" norm-sep" if c.norm_separate else "")
    return (f"{'dot' if c.use_dot else 'fma'} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"
            + (f" sk{c.split_k}" if c.split_k > 1 else "") + (" px" if c.prefetch_x else "")
            + (" norm-sep" if c.norm_separate else ""))


def shipped_config(m: int, n: int, k: int, silu: bool) -> SkinnyConfig | None:
    """This GPU's shipped table entry for the shape (a tile; None for cuBLAS or no entry): always
    a candidate, so a sweep of a few new tiles never ships one slower than the current."""
    cfg = lookup(torch.cuda.get_device_name(), m, n, k, silu)
    if cfg is None:
        return None
    c = SkinnyConfig.from_table(cfg)
    return None if c.cublas else c


def bench_op(shape, op, m, log_rows, only: str = ""):
    name, n, k, norm, silu, resid, f32 = op
    nw = 2 * n if silu else n
    wbytes = nw * k * 2
    copies = l2_defeating_copies(wbytes)
    ws = [torch.randn(nw, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    g = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16() if norm else None
    res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda") if resid else None
    out = torch.empty(m, n, dtype=torch.float32 if f32 else torch.bfloat16, device="cuda")
    nbytes = wbytes + m * k * 2 + m * n * out.element_size() * (2 if resid else 1)

    def fused(w, c, pdl=None):
        return skinny_linear(x, w, norm_weight=g, eps=1e-5, silu=silu,
                             residual=res if resid else None, out=out, config=c, pdl=pdl)

    def unfused(w):
        h = rms_norm(x, g, 1e-5) if norm else x
        y = torch.nn.functional.linear(h, w)
        if silu:
            y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
        if resid:
            y = y + res
        return y.float() if f32 else y

    want = unfused(ws[0]).float()
    results = {}

    def run(c):
        try:
            r0 = res.clone() if resid else None
            got = skinny_linear(x, ws[0], norm_weight=g, eps=1e-5, silu=silu, residual=r0,
                                config=c, out_dtype=out.dtype).float()
            err = ((got - want).norm() / want.norm()).item()
            if not err < 3e-2:
                results[cfg_name(c)] = (c, float("nan"), f"wrong: rel err {err:.3g}")
                return
            results[cfg_name(c)] = (c, graph_time_us([lambda w=w, c=c: fused(w, c) for w in ws]), None)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            results[cfg_name(c)] = (c, float("nan"), repr(e)[:100])

    cands = [c for c in candidates(m, n, k, norm, silu) if not only or only in cfg_name(c)]
    cur = shipped_config(m, n, k, silu)
    if cur is not None and cur not in cands:
        cands.append(cur)
    for c in cands:
        run(c)
    got = skinny_linear(x, ws[0], norm_weight=g, eps=1e-5, silu=silu, config=CUBLAS,
                        residual=res.clone() if resid else None, out_dtype=out.dtype).float()
    assert ((got - want).norm() / want.norm()).item() < 3e-2, "the CUBLAS route is wrong"
    cub = graph_time_us([lambda w=w: fused(w, CUBLAS) for w in ws])
    ok = sorted((v[1], key) for key, v in results.items() if v[1] == v[1])
    best_us, best_key = ok[0]
    bc = results[best_key][0]
    nopdl = graph_time_us([lambda w=w: fused(w, bc, pdl=False) for w in ws])  # PDL A/B
    row = {"shape": shape, "op": name, "M": m, "N": n, "K": k,
           "cublas_us": round(cub, 2), "cublas_gbs": round(nbytes / cub / 1e3),
           "best_us": round(best_us, 2), "best_gbs": round(nbytes / best_us / 1e3), "best_cfg": best_key,
           "speedup": round(cub / best_us, 3), "nopdl_us": round(nopdl, 2),
           "top3": [f"{key} {us:.1f}" for us, key in ok[:3]],
           "failed": {key: v[2] for key, v in results.items() if v[2]},
           "best": bc.to_table()}
    ours = best_us <= cub * OP_MARGIN
    row["table_cfg"] = bc.to_table() if ours else CUBLAS.to_table()
    row["table_us"] = round(best_us if ours else cub, 2)
    log_rows.append(row)
    print({kk: row[kk] for kk in ("shape", "op", "M", "cublas_us", "best_us", "nopdl_us", "best_gbs", "best_cfg",
                                  "speedup", "top3")},
          flush=True)
    del ws
    torch.cuda.empty_cache()
    return row


def write_table(rows: list[dict], ms: list[int], out_path: str | None = None,
                all_ops: bool = True) -> str:
    """Writes this run's winners into the GPU's table (or to out_path, a candidate table for
    `lab.decode_ab --table-ab`), keeping the entries of the GPU's current table for the
    (shape, M) this run did not sweep (and its fused_m for the M it did not, or for every M
    when only some ops were swept: all_ops False)."""
    name = torch.cuda.get_device_name()
    src = table_path(name)
    path = out_path or src
    old = {}
    if os.path.exists(src):
        with open(src) as f:
            old = json.load(f)
    # fused_m: the tuned M whose fused per-step total (each op: our kernel or cuBLAS, as the
    # table says) beats the all-cuBLAS total on every shape swept
    fused_m = [m for m in old.get("fused_m", []) if m not in ms or not all_ops]
    for m in ms if all_ops else []:
        wins = True
        for shape in {r["shape"] for r in rows}:
            sel = [r for r in rows if r["shape"] == shape and r["M"] == m]
            if not sel or step_us(sel, "table_us") * FUSED_MARGIN > step_us(sel, "cublas_us"):
                wins = False
        if wins:
            fused_m.append(m)
    fused_m.sort()
    new = [{"n": r["N"], "k": r["K"], "silu": "silu" in r["op"], "m": r["M"], "cfg": r["table_cfg"],
            "us": r["table_us"], "best_tile_us": r["best_us"], "cublas_us": r["cublas_us"]}
           for r in rows]
    swept = {(e["n"], e["k"], e["silu"], e["m"]) for e in new}
    kept = [e for e in old.get("entries", []) if (e["n"], e["k"], e["silu"], e["m"]) not in swept]
    entries = sorted(kept + new, key=lambda e: (e["k"], e["n"], e["silu"], e["m"]))
    tuned_m = sorted({e["m"] for e in entries})
    doc = {"device": name, "max_m": max(fused_m, default=0), "fused_m": fused_m,
           "fused_margin": FUSED_MARGIN, "op_margin": OP_MARGIN, "tuned_m": tuned_m,
           "note": old.get("note", ""), "source": "lab/skinny_gemm_sweep.py", "entries": entries}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    out = os.environ.get("SPLITSERVE_BENCH_DIR")
    if out:
        with open(os.path.join(out, os.path.basename(path)), "w") as f:
            json.dump(doc, f, indent=1)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64")
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--ops", default="", help="only the ops whose name contains one of these "
                    "(comma-separated, e.g. qkv,o_proj); default all")
    ap.add_argument("--only", default="", help="only the candidates whose name contains this "
                    "(e.g. slab), besides the shipped entry")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--table-out", default=None,
                    help="with --write-table: write the merged table here instead of the shipped one")
    a = ap.parse_args()
    torch.manual_seed(0)
    rgbs = read_gbs()
    print(f"read ceiling {rgbs:.0f} GB/s", flush=True)
    ms = [int(v) for v in a.m.split(",")]
    rows: list[dict] = []
    for shape in a.shapes.split(","):
        for m in ms:
            for op in ops(shape):
                if not a.ops or any(f in op[0] for f in a.ops.split(",")):
                    bench_op(shape, op, m, rows, a.only)
        if a.write_table:  # after each shape: a run cut short still leaves a table
            print("wrote table", write_table(rows, ms, a.table_out, not a.ops), flush=True)
    for shape in a.shapes.split(","):
        for m in ms:
            sel = [r for r in rows if r["shape"] == shape and r["M"] == m and "best" in r]
            cu, be, tb = step_us(sel, "cublas_us"), step_us(sel, "best_us"), step_us(sel, "table_us")
            what = "step matmuls (ops x layers + lm_head)" if not a.ops else f"swept ops x layers ({a.ops})"
            rows.append({"shape": shape, "op": what, "M": m,
                         "cublas_us": round(cu, 1), "best_us": round(be, 1), "table_us": round(tb, 1),
                         "speedup": round(cu / tb, 3)})
    print_table(rows, ["shape", "op", "M", "cublas_us", "cublas_gbs", "best_us", "nopdl_us", "best_gbs",
                       "best_cfg", "table_us", "speedup"])
    tuned = [r for r in rows if "best" in r]
    if a.write_table:
        print("wrote table", write_table(tuned, ms, a.table_out, not a.ops), flush=True)
    path = write_result("skinny_gemm_sweep", {"m": ms, "shapes": a.shapes, "dtype": "bf16",
                                              "read_gbs": round(rgbs, 1)}, {"rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
