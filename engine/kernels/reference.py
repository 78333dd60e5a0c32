"""Torch reference versions of every Triton kernel in engine/kernels/ (the test oracles).

They favour clarity over speed and run on CPU or GPU. Attention references live in
engine/layers/attention.py (write_kv_torch, paged_attention_torch) and are re-exported here
so tests and benchmarks import every oracle from one place.
"""
from __future__ import annotations

import torch

from engine.layers.attention import FP8_MAX, paged_attention_torch, write_kv_torch  # noqa: F401


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """write_kv_torch semantics, but fp8 works on CPU too (index_copy_ has no CPU fp8 kernel,
    so the bytes are copied through a uint8 view)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return write_kv_torch(k, v, kv_cache, slot_mapping)
    nb, bs, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(torch.uint8).view(2, nb * bs, hkv, d)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for i, (x, sc) in enumerate(((k, k_scale), (v, v_scale))):
        q8 = (x[valid].float() / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        flat[i].index_copy_(0, slots, q8.view(torch.uint8))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in fp32, cast back to x's dtype, then scale by weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in x's dtype); returns (rms_norm(residual'), residual')."""
    r = (x + residual).to(x.dtype)
    return rms_norm_ref(r, weight, eps), r


def rope_cos_sin_ref(max_pos: int, rot_dim: int, theta: float = 10000.0,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (unscaled) rotary tables: two [max_pos, rot_dim // 2] float32."""
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    f = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return f.cos(), f.sin()


def rotary_neox_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (rotate halves) on the first rot_dim = 2 * cos.shape[1] features.
    q: [T, Hq, D], k: [T, Hkv, D]; returns new tensors (the kernel works in place)."""
    half = cos.shape[1]
    c = cos[positions.long()][:, None, :]  # [T, 1, half]
    s = sin[positions.long()][:, None, :]

    def rot(x):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        out = xf.clone()
        out[..., :half] = x1 * c - x2 * s
        out[..., half:2 * half] = x2 * c + x1 * s
        return out.to(x.dtype)

    return rot(q), rot(k)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      silu: bool = False, residual: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """engine.kernels.skinny_gemm.skinny_linear in fp32 math with the kernel's rounding
    points: the norm scale applies after the product; silu / residual see the matmul output
    rounded to x's dtype first (as HF rounds every op's output)."""
    adt = x.dtype
    xf = x.float()
    if norm_weight is not None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = ((xf * norm_weight.float()) @ weight.float().T) * rstd
    else:
        y = xf @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if silu:
        n = y.shape[1] // 2
        g, u = y[:, :n].to(adt).float(), y[:, n:].to(adt).float()
        y = torch.nn.functional.silu(g).to(adt).float() * u
    if residual is not None:
        y = y.to(adt).float() + residual.float()
    return y.to(out_dtype or adt)
