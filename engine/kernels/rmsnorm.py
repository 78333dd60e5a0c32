"""Triton RMSNorm and fused residual-add + RMSNorm (one program per row, fp32 math).

Numerics follow HF Llama: normalise in fp32, cast to the input dtype, then multiply by the
weight (so results match engine.kernels.reference bit-for-bit up to reduction order).

PDL (engine/kernels/pdl.py) is off by default (KernelOptions.pdl_rmsnorm): every other kernel
of a decode step launches with it, so this one cuts the step's PDL chain once per layer, and
that cut makes the streaming matmuls around it faster (8B batch-1 steps 10% faster than with
PDL here; measure: python -m lab.decode_ab --kernel-options-b pdl_rmsnorm=True).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import trace
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_mode
from engine.kernels.trace import stamp, stamp_entry


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                    stride_x, stride_r, stride_o, stride_ro, N: tl.constexpr,
                    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
                    trace_ptr, TRACE: tl.constexpr):
    if TRACE:  # engine/kernels/trace.py
        stamp_entry(trace_ptr, tl.program_id(0))
    if PDL:
        # the next kernel may launch now (its pre-wait part only reads weights); nothing of
        # the previous kernel's output is read before the wait
        if PDL == 1:
            gdc_launch_dependents()
        gdc_wait()
        if TRACE:
            stamp(trace_ptr, tl.program_id(0), 2, tl.program_id(0))
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if PDL == 2:  # late trigger (engine/kernels/pdl.py)
        gdc_launch_dependents()
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)
    if TRACE:
        stamp(trace_ptr, tl.program_id(0), 5, tl.program_id(0))


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x.shape[-1]


def _launch(x2, r2, weight, out, res_out, eps, N, kernels: KernelOptions):
    M = x2.shape[0]
    if M == 0:
        return
    BLOCK = triton.next_power_of_2(N)
    nw = 4 if BLOCK <= 2048 else 8
    pdl = pdl_mode(x2.device, late=kernels.pdl_late_trigger) if kernels.pdl_rmsnorm else 0
    tr, traced = trace.buffer("rmsnorm", M, x2, kernels)
    _rmsnorm_kernel[(M,)](x2, r2 if r2 is not None else x2, weight, out,
                          res_out if res_out is not None else out, float(eps),
                          x2.stride(0), (r2 if r2 is not None else x2).stride(0), out.stride(0),
                          (res_out if res_out is not None else out).stride(0),
                          N=N, BLOCK=BLOCK, HAS_RES=r2 is not None, PDL=pdl, trace_ptr=tr,
                          TRACE=traced, num_warps=nw,
                          **pdl_launch(pdl))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """x: [..., hidden]; returns a new tensor like x."""
    x2, N = _check(x, weight)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, None, weight, out, None, eps, N, kernels)
    return out.view(x.shape)


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                  kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """rms_norm into out: x [M, hidden], out [M, hidden] with a unit column stride."""
    x2, N = _check(x, weight)
    if out.shape != x2.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} is not {tuple(x2.shape)} with a unit column stride")
    _launch(x2, None, weight, out, None, eps, N, kernels)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, kernels: KernelOptions = DEFAULT_KERNELS
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual') * weight, residual') as new
    tensors in x's dtype (inputs are not modified)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    x2, N = _check(x, weight)
    r2, _ = _check(residual, weight)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, r2, weight, out, res_out, eps, N, kernels)
    return out.view(x.shape), res_out.view(x.shape)
