"""SwiGLU activation over a fused gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SiluAndMul(torch.nn.Module):
    cpu_ops = None  # engine/layers/cpu_ops.CpuOps on an fp32 CPU model (set by the runner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""
        if self.cpu_ops is not None and not x.is_cuda:
            out = self.cpu_ops.silu_mul(x)
            if out is not None:
                return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
