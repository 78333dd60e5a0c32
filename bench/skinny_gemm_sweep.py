"""Skinny decode GEMM sweep on one GPU: our Triton kernel (every tile config) vs cuBLAS for
the matmuls of a decode step (Llama-3.2-1B and Llama-3.1-8B shapes), M = 1..64 rows.

    python -m bench.skinny_gemm_sweep [--m 1,2,4,8,16,32,64] [--quick]

Timing: each case is captured as a CUDA graph of R launches cycling over enough weight
copies to defeat the 50 MB L2 (>= 512 MB per case); replayed, CUDA events, median of
several replays / R. Bandwidth counts weight + activation bytes read and outputs written.
Ceilings measured in the same run: device copy (read + write) and a pure read (sum).
Prints the best config per case next to default_config's and cuBLAS, writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from bench.common import print_table, write_result
from engine.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_linear

SHAPES = {  # name: (hidden, q+2kv, intermediate, vocab)
    "llama-3.2-1b": (2048, 2048 + 2 * 512, 8192, 128256),
    "llama-3.1-8b": (4096, 4096 + 2 * 1024, 14336, 128256),
}


def cases(shape: str):
    h, qkv, i, v = SHAPES[shape]
    # (op, N_out, K, silu)
    return [("qkv", qkv, h, False), ("o_proj", h, h, False), ("gate_up+silu", i, h, True),
            ("down", h, i, False), ("lm_head", v, h, False)]


def graph_time_us(fn_list, replays: int = 15) -> float:
    """fn_list: callables launched in sequence inside one CUDA graph; -> us per callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:  # warm-up / compile outside capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fn_list))
    del g
    return statistics.median(ts)


def ceilings() -> dict:
    n = 1 << 30
    x = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    cp = graph_time_us([lambda: y.copy_(x)] * 4)
    rd = graph_time_us([lambda: x.sum(dtype=torch.float32)] * 4)
    return {"copy_gbs": round(2 * n / cp / 1e3, 1), "read_gbs": round(n / rd / 1e3, 1)}


def configs(m: int, quick: bool):
    if m == 1:
        fma = [SkinnyConfig(bn, bk, w, st, False)
               for bn, bk, w, st in itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3))]
        if quick:
            fma = fma[::3]
    else:
        fma = []
    dot = [SkinnyConfig(bn, bk, 4, st, True)
           for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 5))]
    if quick:
        dot = dot[::2]
    return fma + dot


def bench_case(m: int, n: int, k: int, silu: bool, cfgs, rows_out: list, shape: str, op: str):
    nw = 2 * n if silu else n
    wbytes = nw * k * 2
    copies = max(2, -(-(512 << 20) // wbytes))
    ws = [torch.randn(nw, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    nbytes = wbytes + m * k * 2 + m * n * 2
    # correctness of every config against fp32 torch on this shape (fresh inputs)
    ref = x.float() @ ws[0].float().T
    if silu:
        ref = torch.nn.functional.silu(ref[:, :n].bfloat16().float()).bfloat16().float() * ref[:, n:].bfloat16().float()
    res = {}
    for c in cfgs:
        try:
            got = skinny_linear(x, ws[0], silu=silu, config=c)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                res[c] = (float("nan"), err)
                continue
            us = graph_time_us([lambda w=w, c=c: skinny_linear(x, w, silu=silu, out=out, config=c) for w in ws])
            res[c] = (us, err)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            res[c] = (float("nan"), repr(e)[:80])
    # cuBLAS (+ a separate silu*mul for gate_up, as the unfused engine does)
    if silu:
        def cub(w):
            y = torch.nn.functional.linear(x, w)
            return torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    else:
        def cub(w):
            return torch.nn.functional.linear(x, w)
    cub_us = graph_time_us([lambda w=w: cub(w) for w in ws])
    dflt = default_config(m, n, k, x.device, silu)
    if dflt not in res:
        got = skinny_linear(x, ws[0], silu=silu, config=dflt)
        res[dflt] = (graph_time_us([lambda w=w: skinny_linear(x, w, silu=silu, out=out, config=dflt) for w in ws]),
                     ((got.float() - ref).norm() / ref.norm()).item())
    ok = {c: v for c, v in res.items() if v[0] == v[0]}
    best = min(ok, key=lambda c: ok[c][0])
    bad = [f"{c}: {v[1]}" for c, v in res.items() if v[0] != v[0]]
    row = {"shape": shape, "op": op, "M": m, "N": n, "K": k,
           "cublas_us": round(cub_us, 2), "cublas_gbs": round(nbytes / cub_us / 1e3),
           "best_us": round(ok[best][0], 2), "best_gbs": round(nbytes / ok[best][0] / 1e3),
           "best_cfg": f"{'dot' if best.use_dot else 'fma'} n{best.block_n} k{best.block_k} w{best.num_warps} s{best.num_stages}",
           "default_us": round(res[dflt][0], 2), "default_gbs": round(nbytes / res[dflt][0] / 1e3),
           "best/cublas": round(cub_us / ok[best][0], 3), "failed_cfgs": len(bad)}
    rows_out.append({**row, "all": {f"{c}": [round(v[0], 2), v[1]] for c, v in res.items()}})
    print({k2: v for k2, v in row.items()}, flush=True)
    if bad:
        print("   failed:", bad[:3], flush=True)
    del ws
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    ceil = ceilings()
    print("ceilings:", ceil, flush=True)
    rows: list[dict] = []
    ms = [int(v) for v in a.m.split(",")]
    for shape in a.shapes.split(","):
        for op, n, k, silu in cases(shape):
            for m in ms:
                bench_case(m, n, k, silu, configs(m, a.quick), rows, shape, op)
    cols = ["shape", "op", "M", "cublas_us", "cublas_gbs", "best_us", "best_gbs", "best_cfg",
            "default_us", "default_gbs", "best/cublas"]
    print_table(rows, cols)
    path = write_result("skinny_gemm_sweep", {"m": ms, "shapes": a.shapes, "dtype": "bf16", **ceil},
                        {"rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
