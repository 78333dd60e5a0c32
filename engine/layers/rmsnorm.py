"""RMSNorm as Llama defines it: normalize in float32, cast back, then scale."""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H]. Without residual: returns norm(x). With residual: adds first and returns
        (norm(x + residual), x + residual) -- the fused pre-norm residual step."""
        if residual is not None:
            x = x + residual
            residual = x
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dt)
        return out if residual is None else (out, residual)
