"""Triton one-row GEMV for decode at batch 1, shaped like a pure streaming read ("slab" GEMV):
y[0, N] = x[0, K] @ W[N, K]^T.

At batch 1 every matmul is a weight stream; lab/kernel_boundary.py measures our tiled
skinny GEMM 1.7-10 us slower per op than a pure read of the same bytes on an H200 (e.g. the
8B gate_up: 60 us against 54 us). The tile grid launches thousands of short programs, each
loading a 2-4 row tile and reducing it once: every program pays its ramp (launch, first-load
latency, a CTA-wide reduction, the store) with nothing else in flight behind it. Here a
one-wave grid (`programs_per_sm` per SM) gives each program a contiguous slab of whole
rows; it walks the slab R rows (R * K * 2 contiguous bytes) per step with the next step's
rows requested before this step's math (register double buffering), so the reduction of one
step hides under the loads of the next. x is read once per program after the grid-dependency
wait and stays in registers; the first step's weights are requested before that wait (PDL).

Fused, each optional: NORM (x := rmsnorm(x) * g, computed once per program from x in
registers and rounded exactly like HF: (x * rstd) to the activation dtype, times g, to the
activation dtype: the rounding points of the separate rmsnorm kernel + GEMV), SILU (W is a
fused [gate | up] weight of 2N rows; y = silu(gate) * up, one slab of gate rows and the
matching up rows), BIAS, RESID (y + residual; out may alias residual). The epilogues are
the skinny GEMM's (skinny_gemm_parts._epilogue), so rounding matches it.

One wave: a table entry asks for a number of programs per SM, but how many fit depends on
the registers the compiler gave the kernel (Triton releases differ), and a second wave would
stall the whole op behind its slowest slab. The first launch of each kernel variant reads its
register and shared-memory use and later launches ask for at most what fits (the split into
slabs never changes a row's result: one program computes each row the same way).

Limit: a whole row lives in registers (BLOCK_K = next power of 2 of K), so K <= MAX_K.

Alone, every one-row op of both Llama shapes is faster as a slab than as a tile, but not
always inside whole steps (the 8B gate_up with its norm fused is slower), so the tuned table,
not this kernel, decides where it runs (measure: python -m lab.skinny_gemm_sweep, then
python -m lab.decode_ab --table-ab CANDIDATE.json; lab/notes/kernels.md has past runs).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from engine.kernels.common import num_sms, programs_that_fit
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_mode
from engine.kernels.skinny_gemm_parts import _epilogue
from engine.kernels import trace
from engine.kernels.trace import stamp, stamp_entry

log = logging.getLogger("splitserve.engine.kernels")

MAX_K = 16384
# (device index, shape, kernel variant) -> programs of it that fit on one SM (first launch)
_FIT: dict[tuple, int] = {}


def _fit_of(compiled, num_warps: int, device: torch.device) -> int | None:
    n_regs = getattr(compiled, "n_regs", None)
    if not n_regs:  # the interpreter, or a Triton that does not report it
        return None
    p = torch.cuda.get_device_properties(device)
    shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
    return programs_that_fit(int(n_regs), num_warps, int(shared),
                             getattr(p, "regs_per_multiprocessor", 65536),
                             getattr(p, "max_threads_per_multi_processor", 2048),
                             getattr(p, "shared_memory_per_multiprocessor", 228 * 1024))


def runs(m: int, weight: torch.Tensor) -> bool:
    """Whether the slab GEMV takes this matmul: one row, contiguous weight rows that fit in
    registers (K <= MAX_K); otherwise a slab table entry runs the tile kernel."""
    return m == 1 and weight.shape[1] <= MAX_K and weight.stride(0) == weight.shape[1]


@triton.jit
def _rows(w_ptr, rows, r_end, offs_k, K, EVEN_K: tl.constexpr):
    """[R, BLOCK_K] whole rows `rows` (those < r_end)."""
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    if EVEN_K:
        return tl.load(ptrs, mask=(rows < r_end)[:, None], other=0.0)
    return tl.load(ptrs, mask=(rows < r_end)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _slab_gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, N, K, up_off,
                      rows_per_prog, eps, R: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM: tl.constexpr, SILU: tl.constexpr, RESID: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                      trace_ptr, TRACE: tl.constexpr):
    if TRACE:  # engine/kernels/trace.py
        stamp_entry(trace_ptr, tl.program_id(0))
    if PDL == 1:
        gdc_launch_dependents()
    r0 = tl.program_id(0) * rows_per_prog  # rows_per_prog: a multiple of R
    r_end = tl.minimum(N, r0 + rows_per_prog)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: nothing before gdc_wait may read activations or write anything
    w = _rows(w_ptr, r0 + offs_r, r_end, offs_k, K, EVEN_K)
    wu = w
    if SILU:
        wu = _rows(w_ptr + up_off.to(tl.int64) * K, r0 + offs_r, r_end, offs_k, K, EVEN_K)
    if PDL:
        gdc_wait()
    if TRACE:
        stamp(trace_ptr, tl.program_id(0), 2, r0)
    adt: tl.constexpr = x_ptr.dtype.element_ty
    if EVEN_K:
        x = tl.load(x_ptr + offs_k).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    if NORM:  # HF's LlamaRMSNorm rounding: weight * (x * rstd).to(dtype), in the dtype
        rstd = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        if EVEN_K:
            g = tl.load(nw_ptr + offs_k)
        else:
            g = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0)
        x = (g.to(tl.float32) * (x * rstd).to(adt).to(tl.float32)).to(adt).to(tl.float32)
    offs_m = tl.arange(0, 1)
    m_mask = offs_m < 1
    for r in range(r0, r_end, R):
        nxt = r + R + offs_r  # the next step's rows, requested before this step's math
        w_next = _rows(w_ptr, nxt, r_end, offs_k, K, EVEN_K)
        wu_next = w_next
        if SILU:
            wu_next = _rows(w_ptr + up_off.to(tl.int64) * K, nxt, r_end, offs_k, K, EVEN_K)
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)[None, :]  # [1, R]
        y_u = y
        if SILU:
            y_u = tl.sum(wu.to(tl.float32) * x[None, :], 1)[None, :]
        cur = r + offs_r
        _epilogue(y, y_u, y, offs_m, cur, m_mask, cur < r_end, out_ptr, res_ptr, bias_ptr, K,
                  0, 0, eps, adt, False, SILU, RESID, HAS_BIAS)
        w = w_next
        wu = wu_next
    if PDL == 2:  # late trigger (engine/kernels/pdl.py)
        gdc_launch_dependents()
    if TRACE:
        stamp(trace_ptr, tl.program_id(0), 5, r_end)


def slab_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, rows_per_step: int,
              programs_per_sm: int, num_warps: int, bias: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu: bool = False,
              residual: torch.Tensor | None = None, pdl: bool | None = None,
              cut: bool = False, kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """x [1, K] (unit stride), weight [N_w, K] contiguous, out [1, N] (N = N_w, or N_w / 2
    with silu) with unit stride; residual [1, N] (may be out). cut: launched without the PDL
    attribute, still letting the next kernel launch early (skinny_linear's cut). Shapes are
    checked by the caller (engine.kernels.skinny_gemm.skinny_linear)."""
    if not runs(x.shape[0], weight):
        raise ValueError(f"slab GEMV: one row and contiguous weight rows of K <= {MAX_K}, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)} stride {weight.stride()}")
    NW, K = weight.shape
    N = NW // 2 if silu else NW
    R = rows_per_step
    pdl = pdl_mode(x.device, pdl, kernels.pdl_late_trigger)
    consts = dict(R=R, BLOCK_K=triton.next_power_of_2(K), NORM=norm_weight is not None, SILU=silu,
                  RESID=residual is not None, HAS_BIAS=bias is not None,
                  EVEN_K=triton.next_power_of_2(K) == K, PDL=pdl)
    key = (x.device.index, N, K, x.dtype, weight.dtype, out.dtype, num_warps, *consts.values())
    fit = _FIT.get(key)
    per_sm = programs_per_sm if fit is None else min(programs_per_sm, fit)
    programs = max(1, min(triton.cdiv(N, R), per_sm * num_sms(x.device)))
    per = triton.cdiv(triton.cdiv(N, programs), R) * R
    grid = triton.cdiv(N, per)
    tr, traced = trace.buffer("slab_gemv", grid, x, kernels)
    compiled = _slab_gemv_kernel[(grid,)](
        x, weight, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, bias if bias is not None else x,
        N, K, N, per, float(eps), trace_ptr=tr, TRACE=traced, num_warps=num_warps, num_stages=1, **consts,
        **pdl_launch(pdl and not cut))
    if fit is None and x.is_cuda:
        fit = _fit_of(compiled, num_warps, x.device)
        if fit is not None:
            _FIT[key] = fit
            if fit < programs_per_sm:
                log.info("slab GEMV (R=%d, %d warps): %d programs per SM asked, %d fit; using %d",
                         R, num_warps, programs_per_sm, fit, fit)
    return out
