"""Triton neox-style rotary embedding, in place on q and k.

q: [T, Hq, D], k: [T, Hkv, D] (last dim contiguous; strided views of a fused qkv are fine).
cos, sin: [max_pos, rot_dim // 2] float32 (any scaling, e.g. llama3, already baked in).
The first rot_dim features rotate by halves: x1 = x[:h], x2 = x[h:2h] ->
(x1 cos - x2 sin, x2 cos + x1 sin); features past rot_dim are untouched.
One program per token, all heads of q and k. Positions are read on device (graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rot_halves(ptr, stride_h, c, s, H, offs_h, offs_r, HALF: tl.constexpr):
    """Rotated halves (fp32) of heads offs_h at ptr: (x1 c - x2 s, x2 c + x1 s), and the mask."""
    mask = (offs_h[:, None] < H) & (offs_r[None, :] < HALF)
    p1 = ptr + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :], mask


@triton.jit
def rotate_rows(ptr, offs_d, c, sn, mask, D: tl.constexpr, HALF: tl.constexpr):
    """rot_halves for a whole head in one [R, D] tile (row offsets already in ptr): each
    feature d reads its partner d +- D/2; the same fp32 products and sums as rot_halves
    (x1 c - x2 s | x2 c + x1 s). c, sn: [D] (the [D/2] rows repeated)."""
    partner = (offs_d + HALF) % D
    xa = tl.load(ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    t1 = xa * c[None, :]
    t2 = xb * sn[None, :]
    return tl.where((offs_d < HALF)[None, :], t1 - t2, t1 + t2)


@triton.jit
def _rotate(ptr, stride_h, c, s, H, offs_h, offs_r, HALF: tl.constexpr):
    r1, r2, mask = rot_halves(ptr, stride_h, c, s, H, offs_h, offs_r, HALF)
    p1 = ptr + offs_h[:, None] * stride_h + offs_r[None, :]
    tl.store(p1, r1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, r2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_cos, HQ: tl.constexpr, HK: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, stride_qh, c, s, HQ, tl.arange(0, BLOCK_HQ), offs_r, HALF)
    _rotate(k_ptr + t * stride_kt, stride_kh, c, s, HK, tl.arange(0, BLOCK_HK), offs_r, HALF)


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k in place. positions: [T] int; cos/sin: [max_pos, rot_dim // 2].
    NOTE: positions must be < max_pos (not checked on device: checking would sync)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} must be [T, heads, head_dim]")
    T, HQ, D = q.shape
    half = cos.shape[1]
    if cos.shape != sin.shape or 2 * half > D:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} bad for head_dim {D}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q, k, cos, sin need a contiguous last dim (cos/sin same strides)")
    if positions.shape[0] != T:
        raise ValueError(f"{positions.shape[0]} positions for {T} tokens")
    if T == 0:
        return
    HK = k.shape[1]
    _rotary_kernel[(T,)](positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                         k.stride(1), cos.stride(0), HQ=HQ, HK=HK, HALF=half,
                         BLOCK_HQ=triton.next_power_of_2(HQ), BLOCK_HK=triton.next_power_of_2(HK),
                         BLOCK_R=triton.next_power_of_2(half), num_warps=4)
