"""Triton kernel: neox rotary on q (in place) and k, then k / v into the paged cache -- the
decode-step fusion of engine.kernels.rotary and engine.kernels.kv_write (one launch per
layer instead of two; each is latency-bound at decode batch sizes).

q: [T, Hq, D], k / v: [T, Hkv, D] (views of a fused qkv are fine; last dim contiguous).
cos, sin: [T', D/2] float32 rows picked by token_index[t] (full rotary: rot_dim == D).
kv_cache: [2, num_blocks, block_size, Hkv, D]; slot -1 = padding (q still rotates, nothing
is written). fp8 caches store value / scale (scales are device scalars: graph safe).
NOTE: k itself is left unrotated: every Triton attention path reads K from the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_write import round_to_e4m3
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_mode
from engine.kernels.rotary import rot_halves


@triton.jit
def _rope_kv_write_kernel(idx_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                          k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                          stride_vt, stride_vh, stride_cos, stride_c_kv, stride_c_slot, stride_c_h,
                          HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
                          IS_FP8: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        # launched early (PDL) so its launch latency hides under the qkv GEMM's tail; the
        # attention kernel after it may launch early too. Nothing is read before the wait.
        if PDL == 1:
            gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(idx_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < HALF
    c = tl.load(cos_ptr + row * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    # q: rotate in place (same rounding as engine.kernels.rotary: fp32 math, one cast)
    offs_hq = tl.arange(0, BLOCK_HQ)
    qp = q_ptr + t * stride_qt
    q1, q2, qmask = rot_halves(qp, stride_qh, c, s, HQ, offs_hq, offs_r, HALF)
    qdst = qp + offs_hq[:, None] * stride_qh + offs_r[None, :]
    tl.store(qdst, q1.to(q_ptr.dtype.element_ty), mask=qmask)
    tl.store(qdst + HALF, q2.to(q_ptr.dtype.element_ty), mask=qmask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_hk = tl.arange(0, BLOCK_HK)
        k1, k2, kmask = rot_halves(k_ptr + t * stride_kt, stride_kh, c, s, HK, offs_hk, offs_r, HALF)
        # k rounds to the activation dtype first, exactly as the unfused rotary kernel's output
        k1 = k1.to(k_ptr.dtype.element_ty)
        k2 = k2.to(k_ptr.dtype.element_ty)
        vp = v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_r[None, :]
        v1 = tl.load(vp, mask=kmask, other=0.0)
        v2 = tl.load(vp + HALF, mask=kmask, other=0.0)
        dst = cache_ptr + slot * stride_c_slot + offs_hk[:, None] * stride_c_h + offs_r[None, :]
        if IS_FP8:
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
            k1 = round_to_e4m3(tl.clamp(k1.to(tl.float32) / ks, -448.0, 448.0))
            k2 = round_to_e4m3(tl.clamp(k2.to(tl.float32) / ks, -448.0, 448.0))
            v1 = round_to_e4m3(tl.clamp(v1.to(tl.float32) / vs, -448.0, 448.0))
            v2 = round_to_e4m3(tl.clamp(v2.to(tl.float32) / vs, -448.0, 448.0))
        cdt = cache_ptr.dtype.element_ty
        if PDL == 2:  # late trigger (engine/kernels/pdl.py)
            gdc_launch_dependents()
        tl.store(dst, k1.to(cdt), mask=kmask)
        tl.store(dst + HALF, k2.to(cdt), mask=kmask)
        tl.store(dst + stride_c_kv, v1.to(cdt), mask=kmask)
        tl.store(dst + stride_c_kv + HALF, v2.to(cdt), mask=kmask)


def rope_write_kv(token_index: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
    """Rotate q in place; write rotated k and v to the cache. See the module docstring."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    half = cos.shape[1]
    if k.shape != (T, HK, D) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} mismatch")
    if 2 * half != D or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} must cover the whole head_dim {D}")
    if kv_cache.dim() != 5 or tuple(kv_cache.shape[3:]) != (HK, D):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match k {tuple(k.shape)}")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be contiguous (flat slot addressing)")
    if min(q.stride(-1), k.stride(-1), v.stride(-1), cos.stride(-1), kv_cache.stride(-1)) != 1:
        raise ValueError("q, k, v, cos/sin and kv_cache need a contiguous last dim")
    if token_index.shape[0] != T or slot_mapping.shape[0] < T:
        raise ValueError(f"token_index / slot_mapping shorter than {T} tokens")
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV cache needs k_scale and v_scale")
    if T == 0:
        return
    ks = k_scale if is_fp8 else cos
    vs = v_scale if is_fp8 else cos
    pdl = pdl_mode(q.device, late=kernels.pdl_late_trigger)
    _rope_kv_write_kernel[(T,)](
        token_index, q, k, v, cos, sin, kv_cache, slot_mapping, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        HQ=HQ, HK=HK, HALF=half, BLOCK_HQ=triton.next_power_of_2(HQ),
        BLOCK_HK=triton.next_power_of_2(HK), BLOCK_R=triton.next_power_of_2(half),
        IS_FP8=is_fp8, PDL=pdl, num_warps=4, **pdl_launch(pdl))
