"""Triton paged decode attention (one query token per sequence), flash-decoding style.

Stage 1 (_decode_split_kernel), grid (num_seqs, num_kv_heads, num_splits): each program takes
ALL query heads of one KV head group (GQA) so every K/V byte is read once, and one contiguous
slice of the sequence's context. It writes a normalised partial output and its log-sum-exp
(base 2). Stage 2 (_decode_reduce_kernel), grid (num_seqs, num_heads), merges the splits.
With num_splits == 1 stage 1 writes the final output directly. num_splits is a runtime
argument (only ==1 vs >1 compiles differently), so tuning it costs no recompiles.

CUDA-graph safety: no host reads of device data; the grid depends only on tensor shapes
(num_splits is chosen from block_tables.shape, not from seq_lens values).
NOTE: a sequence with seq_len 0 (graph padding) produces a zero output row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import decode_tiles
from engine.kernels.common import dot_precision, upcast_dots
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_mode
from engine.kernels import trace
from engine.kernels.rotary import rotate_rows
from engine.kernels.trace import stamp, stamp_entry


LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(k_base, v_base, bt_row, offs_n, end, offs_d, d_mask, stride_c_slot, BS: tl.constexpr):
    # [BLOCK_N, D_PAD] K and V rows of context positions offs_n (masked past `end`)
    n_mask = offs_n < end
    blk = tl.load(bt_row + offs_n // BS, mask=n_mask, other=0).to(tl.int64)
    kv_off = (blk * BS + offs_n % BS)[:, None] * stride_c_slot + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """Online-softmax update with one [BLOCK_N, D_PAD] K/V tile (positions past the split
    masked by n_mask); q [G_PAD, D_PAD] in the dot dtype."""
    cdt = q.dtype
    qk = tl.dot(q, tl.trans(k.to(cdt)), input_precision=PREC) * qk_scale  # [G_PAD, BLOCK_N]
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v.to(cdt), input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _new_kv_row(kn_ptr, vn_ptr, s, kvh, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, c, sn,
                cdt: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """The new token's rotated k and its v for KV head kvh, [1, D] each, in the cache dtype."""
    one = tl.arange(0, 1)
    krow = kn_ptr + s.to(tl.int64) * stride_kt + kvh * stride_kh + one[:, None] * 0
    kr = rotate_rows(krow, offs_d, c, sn, one[:, None] >= 0, D, HALF)
    kr = kr.to(kn_ptr.dtype.element_ty)  # rounds like the unfused rotary's output
    vv = tl.load(vn_ptr + s.to(tl.int64) * stride_vt + kvh * stride_vh + offs_d[None, :] + one[:, None] * 0)
    return kr.to(cdt), vv.to(cdt)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                         out_ptr, part_o_ptr, part_lse_ptr, sm_scale, num_splits,
                         stride_qt, stride_qh, stride_c_kv, stride_c_slot, stride_c_h, stride_bt,
                         stride_ot, stride_oh,
                         kn_ptr, vn_ptr, cos_ptr, sin_ptr, idx_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                         IS_FP8: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                         PREFETCH: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
                         trace_ptr, TRACE: tl.constexpr):
    if TRACE:  # engine/kernels/trace.py
        tpid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        stamp_entry(trace_ptr, tpid)
    if PDL:
        # Launched with PDL: the CTAs are resident before the previous kernel (rotary + KV
        # write) ends, so its launch latency is hidden; nothing is read before the wait.
        # The next kernel (o_proj or the reduce pass, launched with PDL) may start now; it
        # waits for this grid's completion before reading the attention output.
        if PDL == 1:
            gdc_launch_dependents()
        gdc_wait()
        if TRACE:
            stamp(trace_ptr, tpid, 2, tpid)
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)

    # this split's context slice: whole BLOCK_N tiles, [start, end)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kvh * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < D
    k_base = cache_ptr + kvh * stride_c_h
    v_base = k_base + stride_c_kv
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    if ROPE:
        # fused rotary + KV append (16-bit caches, D == D_PAD): q and the new token's k are
        # rotated here from the un-rotated qkv; the split holding the new position writes
        # its k / v to the cache before reading the context (same CTA: a barrier suffices)
        HALF: tl.constexpr = D // 2
        row = tl.load(idx_ptr + s).to(tl.int64)
        c = tl.load(cos_ptr + row * stride_cos + offs_d % HALF)
        sn = tl.load(sin_ptr + row * stride_cos + offs_d % HALF)
        qrows = q_ptr + s.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        q = rotate_rows(qrows, offs_d, c, sn, g_mask[:, None], D, HALF).to(q_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + s).to(tl.int64)
        last = seq_len - 1
        if (start <= last) & (last < end) & (slot >= 0):
            new_k, new_v = _new_kv_row(kn_ptr, vn_ptr, s, kvh, stride_kt, stride_kh, stride_vt,
                                       stride_vh, offs_d, c, sn, cache_ptr.dtype.element_ty, D, HALF)
            dst = cache_ptr + slot * stride_c_slot + kvh * stride_c_h + offs_d[None, :]
            tl.store(dst, new_k)
            tl.store(dst + stride_c_kv, new_v)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + s.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    if IS_FP8:
        # fp8 -> fp16 is one instruction (fp8 -> bf16 is not); |q| < 65504 assumed
        q = q.to(tl.float16)
    elif UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if TRACE:
        stamp(trace_ptr, tpid, 3, (tl.sum(q.to(tl.float32)) != 0.0).to(tl.int32))

    if TRACE == 2:  # KernelOptions.trace_probe: the first tile's loads, timed alone
        offs_p = start + tl.arange(0, BLOCK_N)
        blk_p = tl.load(bt_row + offs_p // BS, mask=offs_p < end, other=0)
        stamp(trace_ptr, tpid, 6, tl.max(blk_p, 0))
        k_p, v_p = _load_kv_tile(k_base, v_base, bt_row, offs_p, end, offs_d, d_mask, stride_c_slot, BS)
        stamp(trace_ptr, tpid, 7, (tl.sum(k_p.to(tl.float32)) + tl.sum(v_p.to(tl.float32)) != 0.0).to(tl.int32))
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if PREFETCH:
        # manual register double buffering: tile i+1's loads are issued before tile i's math
        offs_n = start + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(k_base, v_base, bt_row, offs_n, end, offs_d, d_mask, stride_c_slot, BS)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            offs_nx = offs_n + BLOCK_N
            k_nx, v_nx = _load_kv_tile(k_base, v_base, bt_row, offs_nx, end, offs_d, d_mask,
                                       stride_c_slot, BS)
        else:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _load_kv_tile(k_base, v_base, bt_row, offs_n, end, offs_d, d_mask, stride_c_slot, BS)
        m_i, l_i, acc = _attend_tile(q, k, v, offs_n < end, m_i, l_i, acc, qk_scale, PREC)
        if PREFETCH:
            k = k_nx
            v = v_nx
            offs_n = offs_nx

    if PDL == 2:  # late trigger (engine/kernels/pdl.py): the context is read
        gdc_launch_dependents()
    if TRACE:
        stamp(trace_ptr, tpid, 4, (tl.sum(l_i) > 0.0).to(tl.int32))
    if IS_FP8:
        acc = acc * tl.load(v_scale_ptr)
    has = l_i > 0.0  # false for an empty split / empty sequence
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # num_splits == 1: no reduce pass
        tl.store(out_ptr + s.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        # partial buffers: o [S, Hq, num_splits, D_PAD] fp32, lse [S, Hq, num_splits] fp32
        row = (s.to(tl.int64) * (G * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_o_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
    if TRACE:
        stamp(trace_ptr, tpid, 5, tpid)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                          D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          PDL: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    if TRACE:  # engine/kernels/trace.py
        tpid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        stamp_entry(trace_ptr, tpid)
    if PDL:
        if PDL == 1:
            gdc_launch_dependents()  # see _decode_split_kernel
        gdc_wait()
        if TRACE:
            stamp(trace_ptr, tpid, 2, tpid)
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = s.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    o = tl.load(part_o_ptr + (row * num_splits + offs_s)[:, None] * D_PAD + offs_d[None, :],
                mask=s_mask[:, None], other=0.0)
    tot = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)
    if PDL == 2:  # late trigger (engine/kernels/pdl.py)
        gdc_launch_dependents()
    tl.store(out_ptr + s.to(tl.int64) * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)
    if TRACE:
        stamp(trace_ptr, tpid, 5, tpid)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           prefetch: bool | None = None, new_kv: tuple | None = None,
                           kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] (one token per sequence, row i = sequence i).
    Returns [num_seqs, num_heads, head_dim] in q's dtype (or writes `out`).
    new_kv = (k, v, cos, sin, token_index, slot_mapping): fused rotary + KV append: q and k
    are the UN-rotated projections (k, v: [num_seqs, Hkv, D]; cos/sin rows token_index[i];
    slot -1 writes nothing); the kernel rotates q, writes rotated k and v to the cache at
    slot_mapping[i] and attends, replacing engine.kernels.rope_kv_write + this kernel
    (16-bit caches, power-of-two head_dim, full rotary). q is not modified.
    kernels: the tile choice and PDL launches (KernelOptions' decode attention fields)."""
    S, Hq, D = q.shape
    _, _, BS, Hkv, Dc = kv_cache.shape
    if Dc != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} incompatible with kv_cache {tuple(kv_cache.shape)}")
    if block_tables.shape[0] < S or seq_lens.shape[0] < S:
        raise ValueError("block_tables / seq_lens have fewer rows than q")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dim")
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV cache needs k_scale and v_scale")
    if out is None:
        out = torch.empty_like(q)
    if S == 0:
        return out
    G = Hq // Hkv
    D_PAD = triton.next_power_of_2(D)
    # each argument left None takes the tile's value
    tile = decode_tiles.default_tile(is_fp8, D_PAD, S * Hkv, q.device, kernels)
    block_n = tile.block_n if block_n is None else block_n
    num_warps = tile.num_warps if num_warps is None else num_warps
    num_stages = tile.num_stages if num_stages is None else num_stages
    prefetch = tile.prefetch if prefetch is None else prefetch
    if num_splits is None:
        num_splits = decode_tiles.choose_num_splits(S, Hkv, block_tables.shape[1], BS, block_n, q.device,
                                                    tile.programs_per_sm, tile.min_tiles_per_split)
    rope = _check_new_kv(new_kv, q, kv_cache, is_fp8, D, D_PAD) if new_kv is not None else None
    if num_splits > 1:
        part_o = torch.empty((S, Hq, num_splits, D_PAD), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((S, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    ks = k_scale if is_fp8 else seq_lens
    vs = v_scale if is_fp8 else seq_lens
    pdl = pdl_mode(q.device, late=kernels.pdl_late_trigger)
    pdl_split = pdl if kernels.pdl_split else 0
    pdl_reduce = pdl if kernels.pdl_reduce else 0
    tr, traced = trace.buffer("decode_split", S * Hkv * num_splits, q, kernels)
    _decode_split_kernel[(S, Hkv, num_splits)](
        q, kv_cache, block_tables, seq_lens, ks, vs, out, part_o, part_lse, float(scale), num_splits,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        *(rope if rope is not None else (q,) * 6 + (0,) * 5),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=D_PAD, BS=BS, BLOCK_N=block_n,
        DIRECT=num_splits == 1, IS_FP8=is_fp8, PREC=None if is_fp8 else dot_precision(torch.float32 if upcast_dots(q.dtype) else q.dtype),
        UPCAST=upcast_dots(q.dtype), PREFETCH=prefetch, PDL=pdl_split, ROPE=rope is not None,
        trace_ptr=tr, TRACE=traced, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(pdl_split and not (kernels.cut_split or tile.cut)))
    if num_splits > 1:
        tr, traced = trace.buffer("decode_reduce", S * Hq, q, kernels)
        _decode_reduce_kernel[(S, Hq)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_splits, D=D, D_PAD=D_PAD,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), PDL=pdl_reduce,
            trace_ptr=tr, TRACE=traced, num_warps=4,
            **pdl_launch(pdl_reduce))
    return out


def _check_new_kv(new_kv, q, kv_cache, is_fp8, D, D_PAD) -> tuple:
    k, v, cos, sin, idx, slots = new_kv
    S, _, _ = q.shape
    Hkv = kv_cache.shape[3]
    if is_fp8 or D != D_PAD:
        raise ValueError("fused rotary + KV append needs a 16-bit cache and a power-of-two head_dim")
    if k.shape != (S, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} are not [{S}, {Hkv}, {D}]")
    if 2 * cos.shape[1] != D or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} must cover the whole head_dim {D}")
    if min(k.stride(-1), v.stride(-1), cos.stride(-1)) != 1:
        raise ValueError("k, v and cos/sin need a contiguous last dim")
    if idx.shape[0] < S or slots.shape[0] < S:
        raise ValueError(f"token_index / slot_mapping shorter than {S} sequences")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be contiguous (flat slot addressing)")
    return (k, v, cos, sin, idx, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0))
