"""SwiGLU activation over a fused gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SiluAndMul(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
