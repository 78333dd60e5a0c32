"""Rotary position embeddings (GPT-NeoX / HF "rotate_half" layout), with Llama-3 and
linear frequency scaling.

cos/sin are computed from `positions` on every call (inv_freq is a small buffer): no
position cache to outgrow, and CUDA-graph safe (fixed shapes in, fixed shapes out).
"""
from __future__ import annotations

import math

import torch


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, matching HF's rope init functions."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    rt = scaling["rope_type"]
    if rt == "linear":
        return inv / float(scaling["factor"])
    if rt == "factors":
        f = torch.tensor(scaling["factors"], dtype=torch.float32)
        if f.shape != inv.shape:
            raise ValueError(f"rope factors: {tuple(f.shape)} values for {inv.shape[0]} frequencies")
        return inv / f
    if rt == "llama3":
        factor = float(scaling["factor"])
        lo = float(scaling["low_freq_factor"])
        hi = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        # long wavelengths: divided by factor; short: unchanged; between: smooth blend
        out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return torch.where(medium, blended, out)
    raise ValueError(f"unsupported rope_type {rt!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        # NOTE: not persistent: never part of a state dict, always recomputed in float32
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long -> cos, sin [T, head_dim // 2] float32."""
        inv = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (same shapes and dtype)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. Rotates pairs (i, i + D/2), computed in x's dtype
    like HF (cos/sin cast down first)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
