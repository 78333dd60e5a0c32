"""Triton kernel: scatter this step's K/V tokens into the paged cache through slot_mapping.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot s = block * block_size + row.
Slot -1 marks a padding token (CUDA-graph padding): it is skipped, never written.
fp8_e4m3 caches store value / scale clamped to +-448; scales are 0-dim/1-element device tensors
read inside the kernel, so no host sync happens (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def round_to_e4m3(x):
    """Round fp32 (already clamped to +-448) to the nearest e4m3 value, ties to even, so the
    following .to(float8e4nv) is exact. NOTE: needed because the Triton interpreter's fp8
    downcast drops the carry into the exponent (7.9 -> 4.0); on GPU it is a no-op in effect."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 of 23 mantissa bits (RTNE via bias + lsb)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = rb.to(tl.float32, bitcast=True)
    # subnormal range (|x| < 2^-6): multiples of 2^-9; fp32 add at 2^14 rounds there (RTNE)
    # (on |x|: just below 2^14 the fp32 spacing halves, so negative x would round too finely)
    ax = tl.abs(x)
    sub = (ax + 16384.0) - 16384.0
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_slot, stride_c_h,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr):
    # one program per token: all kv heads of its K and V row
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = cache_ptr + slot * stride_c_slot + offs_h[:, None] * stride_c_h + offs_d[None, :]
        if IS_FP8:
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
            k = round_to_e4m3(tl.clamp(k.to(tl.float32) / ks, -448.0, 448.0))
            v = round_to_e4m3(tl.clamp(v.to(tl.float32) / vs, -448.0, 448.0))
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (last dim contiguous; views of a fused qkv
    are fine). slot_mapping: [num_tokens] int32/int64, -1 = skip."""
    T, H, D = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (H, D):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match k {tuple(k.shape)}")
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("last dim of k, v and kv_cache must be contiguous")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be contiguous (flat slot addressing)")
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV cache needs k_scale and v_scale")
    if T == 0:
        return
    ks = k_scale if is_fp8 else slot_mapping  # dummy pointer when unused
    vs = v_scale if is_fp8 else slot_mapping
    _kv_write_kernel[(T,)](
        k, v, kv_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        IS_FP8=is_fp8, num_warps=4)
