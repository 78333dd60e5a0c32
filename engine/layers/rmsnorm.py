"""RMSNorm as Llama defines it: normalize in float32, cast back, then scale. On CUDA the
(fused residual-add +) norm runs as one Triton kernel (engine.kernels.rmsnorm)."""
from __future__ import annotations

import functools

import torch

from engine.kernels.options import DEFAULT_KERNELS, KernelOptions


@functools.lru_cache(maxsize=1)
def _triton_norms():
    try:
        from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm

        return rms_norm, fused_add_rms_norm
    except Exception:  # no triton: torch path
        return None


class RMSNorm(torch.nn.Module):
    cpu_ops = None  # engine/layers/cpu_ops.CpuOps on an fp32 CPU model (set by the runner)

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__()
        self.eps = eps
        self.kernels = kernels  # the Triton kernel's launch (KernelOptions.pdl_rmsnorm, trace)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H]. Without residual: returns norm(x). With residual: adds first and returns
        (norm(x + residual), x + residual) -- the fused pre-norm residual step."""
        kern = _triton_norms() if x.is_cuda else None
        if kern is not None:
            if residual is None:
                return kern[0](x, self.weight, self.eps, self.kernels)
            return kern[1](x, residual, self.weight, self.eps, self.kernels)
        if self.cpu_ops is not None and not x.is_cuda:
            r = self.cpu_ops.rms_norm(x, residual, self.weight, self.eps)
            if r is not None:
                return r
        if residual is not None:
            x = x + residual
            residual = x
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dt)
        return out if residual is None else (out, residual)
