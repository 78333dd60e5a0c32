"""What a kernel boundary costs inside a CUDA graph (diagnostic, one GPU).

    python -m lab.kernel_boundary [--sizes-mb 8,34,50,117,235] [--chain 32]

A decode step at batch 1 is a chain of ~6 dependent kernels per layer, most of them
weight-streaming matmuls. This measures, for chains of identical kernels replayed as one
CUDA graph (median per kernel):
  empty:     1-program-per-SM kernels that do nothing but the grid-dependency handshake:
             the floor of a boundary, plain launch vs programmatic dependent launch (PDL);
  read, wait first:  a pure streaming read of S MB (each program sums its contiguous slice,
             16 KB chunks) that waits for the previous kernel before its first load, which
             is where a dependent matmul stands (it must read the previous kernel's output);
  read, wait last:   the same read with every load issued before the wait (only the final
             store waits): the ideal overlap PDL allows for bytes that do not depend on the
             previous kernel, i.e. what a weight stream could reach with no boundary cost.
Bandwidth = S / time. Compare with the skinny matmuls of lab/skinny_gemm_sweep.py.
  overlap depth: a latency-bound kernel (one program per SM spinning ~10 us, like decode
             attention at batch 1, which leaves HBM idle) followed by a 34 MB read that issues
             its loads before its wait, directly or behind one more tiny PDL kernel (like the
             attention's split reduce before o_proj): whether the read can start under the
             spin through an intermediate kernel, or only through a direct edge.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.common import print_table, write_result
from bench.timing import graph_time_ms, l2_defeating_copies
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch

CHUNK = 8192  # bf16 elements per program per loop step (16 KB)


@triton.jit
def _empty_kernel(out_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(out_ptr, 1.0)


@triton.jit
def _read_kernel(x_ptr, out_ptr, per_prog, PDL: tl.constexpr, WAIT_LAST: tl.constexpr,
                 BLOCK: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        if not WAIT_LAST:
            gdc_wait()
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_prog, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    s = tl.sum(acc, 0)
    if PDL:
        if WAIT_LAST:
            gdc_wait()
    tl.store(out_ptr + pid, s)


@triton.jit
def _spin_kernel(out_ptr, iters, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    a = tl.program_id(0).to(tl.float32)
    for _ in range(iters):  # a serial chain: latency, no memory traffic
        a = a * 0.999 + 1.0
    tl.store(out_ptr + tl.program_id(0), a)


def overlap_rows(sms: int, reps: int = 16) -> list[dict]:
    n = (34 << 20) // 2
    progs = 4 * sms
    per = (n // progs) // CHUNK * CHUNK
    xs = [torch.randn(per * progs, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
    out = torch.zeros(progs, device="cuda")
    sp = torch.zeros(sms, device="cuda")
    pdl = {"launch_pdl": True}
    iters = 2000

    def spin():
        _spin_kernel[(sms,)](sp, iters, PDL=True, num_warps=4, **pdl)

    def tiny():
        _empty_kernel[(sms,)](out, PDL=True, num_warps=4, **pdl)

    def read(x, last):
        _read_kernel[(progs,)](x, out, per, PDL=True, WAIT_LAST=last, BLOCK=CHUNK, num_warps=8, **pdl)

    cases = {"spin": lambda x: [spin],
             "spin -> tiny": lambda x: [spin, tiny],
             "spin -> read (wait first)": lambda x: [spin, lambda: read(x, False)],
             "spin -> read (loads before wait)": lambda x: [spin, lambda: read(x, True)],
             "spin -> tiny -> read (wait first)": lambda x: [spin, tiny, lambda: read(x, False)],
             "spin -> tiny -> read (loads before wait)": lambda x: [spin, tiny, lambda: read(x, True)]}
    rows = []
    for name, make in cases.items():
        fns = [f for i in range(reps) for f in make(xs[i % len(xs)])]
        per_iter = graph_time_ms(fns) * len(fns) / reps * 1e3
        rows.append({"case": f"overlap: {name}", "us_per_chain": round(per_iter, 2)})
        print(rows[-1], flush=True)
    del xs
    torch.cuda.empty_cache()
    return rows


def gemv_rows(sizes: list[tuple]) -> list[dict]:
    """Our one-row skinny matmul on the same bytes as the reads: the 8B gate_up weight as a
    plain 28672-row GEMV, as gate_up+silu, and as norm+gate_up+silu (the shipped op), each with
    the shipped table's tile, one fixed tile and a few slab GEMVs, chained like the reads (PDL)."""
    from engine.kernels.skinny_configs import SkinnyConfig, default_config
    from engine.kernels.skinny_gemm import skinny_linear

    rows = []
    fixed = SkinnyConfig(4, 512, 4, 3, False)
    for name, n_w, k, silu, norm in sizes:
        n = n_w // 2 if silu else n_w
        copies = l2_defeating_copies(n_w * k * 2)
        ws = [torch.randn(n_w, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16) if norm else None
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        r = {"case": f"gemv {name}"}
        # the slab GEMV (engine/kernels/slab_gemv.py): R rows a step, P programs per SM
        slabs = ((1, 8, 4), (2, 8, 3), (4, 8, 2)) if k <= 8192 else ((1, 8, 2), (2, 8, 1))
        cfgs = [("table", default_config(1, n, k, x.device, silu)), ("n4k512", fixed)] + [
            (f"slab{rps}", SkinnyConfig(rps, 4096, warps, 1, False, slab=per_sm)) for rps, warps, per_sm in slabs]
        for label, cfg in cfgs:
            fns = [lambda w=w, c=cfg: skinny_linear(x, w, norm_weight=g, silu=silu, out=out, config=c)
                   for w in ws]
            us = graph_time_ms(fns) * 1e3
            r[f"{label}_us"] = round(us, 2)
            r[f"{label}_gbs"] = round(n_w * k * 2 / us / 1e3)
        rows.append(r)
        print(r, flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def empty_chain_us(grid: int, pdl: bool, chain: int) -> float:
    out = torch.zeros(1, device="cuda")
    launch = pdl_launch(pdl)

    def one():
        _empty_kernel[(grid,)](out, PDL=pdl, num_warps=4, **launch)
    return graph_time_ms([one] * chain) * 1e3


def read_chain_us(size_mb: float, mode: str, chain: int, sms: int) -> tuple[float, int]:
    """(us per read, bytes read); mode: 'plain' (no PDL), 'wait_first', 'wait_last'. Copies
    cycle to defeat the L2."""
    n = int(size_mb * (1 << 20)) // 2
    progs = 4 * sms  # 4 resident programs per SM, one wave
    per = max(CHUNK, (n // progs) // CHUNK * CHUNK)
    n = per * progs
    copies = l2_defeating_copies(n * 2)
    xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    out = torch.empty(progs, device="cuda")
    pdl = mode != "plain"
    launch = pdl_launch(pdl)
    fns = [lambda x=x: _read_kernel[(progs,)](x, out, per, PDL=pdl, WAIT_LAST=mode == "wait_last",
                                              BLOCK=CHUNK, num_warps=8, **launch)
           for x in xs]
    fns = (fns * (-(-chain // len(fns))))[:max(chain, len(fns))]
    us = graph_time_ms(fns) * 1e3
    del xs
    torch.cuda.empty_cache()
    return us, n * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="8,34,50,117,235")
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--gemv-only", action="store_true", help="only the skinny-matmul rows")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for grid in (() if a.gemv_only else (sms, 8 * sms)):
        r = {"case": f"empty kernel, grid {grid}"}
        for pdl in (False, True):
            r["pdl_us" if pdl else "plain_us"] = round(empty_chain_us(grid, pdl, 4 * a.chain), 2)
        rows.append(r)
        print(r, flush=True)
    for mb in (float(v) for v in a.sizes_mb.split(",") if v and not a.gemv_only):
        r = {"case": f"read {mb:g} MB"}
        for mode in ("plain", "wait_first", "wait_last"):
            us, nbytes = read_chain_us(mb, mode, a.chain, sms)
            r[f"{mode}_us"] = round(us, 2)
            r[f"{mode}_gbs"] = round(nbytes / us / 1e3)
        rows.append(r)
        print(r, flush=True)
    if not a.gemv_only:
        rows += overlap_rows(sms)
    rows += gemv_rows([("28672x4096 plain", 28672, 4096, False, False),
                       ("28672x4096 silu", 28672, 4096, True, False),
                       ("28672x4096 norm+silu", 28672, 4096, True, True),
                       ("4096x14336 plain", 4096, 14336, False, False),
                       ("4096x4096 plain", 4096, 4096, False, False),
                       ("6144x4096 norm", 6144, 4096, False, True)])
    print_table(rows, ["case", "plain_us", "pdl_us", "plain_gbs", "wait_first_us", "wait_first_gbs",
                       "wait_last_us", "wait_last_gbs", "us_per_chain", "table_us", "table_gbs",
                       "n4k512_us", "n4k512_gbs", "slab1_us", "slab2_us", "slab4_us"])
    print("wrote", write_result("kernel_boundary", {"sizes_mb": a.sizes_mb, "chain": a.chain,
                                                    "sms": sms}, {"rows": rows}))


if __name__ == "__main__":
    main()
