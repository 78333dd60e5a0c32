"""Rotary position embeddings (GPT-NeoX / HF "rotate_half" layout), with Llama-3, linear and
per-frequency-factor scaling.

cos/sin are computed from `positions` once per forward ([T, head_dim/2] float32, shared by
all layers): no position table to outgrow, and CUDA-graph safe. On CUDA the rotation runs
in place through the Triton kernel (engine.kernels.rotary); elsewhere in torch.
"""
from __future__ import annotations

import functools
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
        f = torch.tensor(scaling["factors"], dtype=torch.float32, device=inv.device)
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


@functools.lru_cache(maxsize=1)
def _triton_rotary():
    try:
        from engine.kernels.rotary import rotary_neox_

        return rotary_neox_
    except Exception:  # no triton / no GPU toolchain: torch path
        return None


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        # NOTE: a plain attribute, not a buffer: model.to(dtype=bf16) must not round the
        # frequencies; _apply below moves it across devices and keeps it float32.
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.zeros(1, device=self.inv_freq.device))
        self.inv_freq = self.inv_freq.to(device=probe.device, dtype=torch.float32)
        return super()._apply(fn, recurse)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long -> cos, sin [T, head_dim // 2] float32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              token_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]; cos/sin [T, D/2] for these tokens. Returns rotated
        q, k (on CUDA: rotated in place; token_index = arange(T) lets the kernel read row t)."""
        return rotate_qk(q, k, cos, sin, token_index)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.apply(q, k, cos, sin)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              token_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See RotaryEmbedding.apply."""
    kern = _triton_rotary() if q.is_cuda else None
    if kern is not None:
        idx = token_index if token_index is not None else torch.arange(q.shape[0], device=q.device)
        kern(idx, q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. Rotates pairs (i, i + D/2), computed in x's dtype
    like HF (cos/sin cast down first)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
