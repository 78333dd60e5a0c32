"""Triton varlen attention over the paged KV cache (prefill chunks, decode rows, mixed).

Batch layout as AttentionMetadata: sequence i owns query rows query_start_loc[i]:[i+1] and
a context of seq_lens[i] tokens (cached prefix + these rows, already written to the cache);
its query rows sit at positions seq_len - q_len .. seq_len - 1 and attend causally.

Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): program (b, kvh) finds its sequence by
a binary search over query_start_loc (q-block b belongs to sequence i when
qsl[i] // BLOCK_Q + i <= b < qsl[i+1] // BLOCK_Q + i + 1), so the grid depends only on tensor
shapes and no host sync is needed (CUDA-graph safe). Surplus programs exit at once.
Padding as prefill CUDA graphs use it (engine/graphs_prefill.py): token rows past
query_start_loc[-1] belong to no sequence and are never written; trailing sequences whose
query_start_loc entries repeat the token count own no rows (their programs exit before reading
seq_lens or the block table, whatever those hold); block-table entries past
ceil(seq_len / BS) are never read (the unmasked loop stops below the tile's first query
position, the masked one masks keys >= seq_len).
A program's tile is BLOCK_Q query tokens x all G query heads of one KV head (rows = token*G_PAD
+ head), so each K/V tile is read once per GQA group. Online softmax, fp32 accumulators.
Keys strictly before the tile's first query position need no mask (first loop); the diagonal
part is masked (second loop).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_precision, upcast_dots


@triton.jit
def _find_seq(qsl_ptr, b, num_seqs, BLOCK_Q: tl.constexpr):
    # last i in [0, num_seqs) with qsl[i] // BLOCK_Q + i <= b
    # NOTE: typed so the loop-carried values stay int32 tensors even when num_seqs arrives
    # as a specialised constant
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if val <= b:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, qpos, n_lo, n_hi, seq_len, qk_scale,
                stride_c_slot, offs_d, d_mask, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, PREC: tl.constexpr):
    cdt = q.dtype
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = offs_n < seq_len
            blk = tl.load(bt_row + offs_n // BS, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blk = tl.load(bt_row + offs_n // BS).to(tl.int64)
            kv_mask = d_mask[None, :]
        kv_off = (blk * BS + offs_n % BS)[:, None] * stride_c_slot + offs_d[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0).to(cdt)  # [BLOCK_N, D_PAD]
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0).to(cdt)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            ok = (offs_n[None, :] <= qpos[:, None]) & n_mask[None, :]
            qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # rows with nothing visible yet keep m = -inf; guard the -inf - -inf NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, k_scale_ptr, v_scale_ptr,
                    out_ptr, sm_scale, num_seqs,
                    stride_qt, stride_qh, stride_c_kv, stride_c_slot, stride_c_h, stride_bt,
                    stride_ot, stride_oh,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    IS_FP8: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = _find_seq(qsl_ptr, b, num_seqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_begin
    q0 = (b - (q_begin // BLOCK_Q + s)) * BLOCK_Q  # first local query row of this tile
    if q0 < q_len:
        seq_len = tl.load(seq_lens_ptr + s)
        ctx = seq_len - q_len  # position of local query row 0

        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        offs_m = tl.arange(0, BLOCK_M)
        tok = q0 + offs_m // G_PAD
        g = offs_m % G_PAD
        heads = kvh * G + g
        row_mask = (tok < q_len) & (g < G)
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < D
        qrow = (q_begin + tok).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
        if IS_FP8:
            q = q.to(tl.float16)  # fp8 -> fp16 converts in one instruction; |q| < 65504 assumed
        elif UPCAST:
            q = q.to(tl.float32)
        qpos = ctx + tok
        qk_scale = sm_scale * 1.4426950408889634
        if IS_FP8:
            qk_scale = qk_scale * tl.load(k_scale_ptr)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        k_base = cache_ptr + kvh * stride_c_h
        v_base = k_base + stride_c_kv
        bt_row = bt_ptr + s.to(tl.int64) * stride_bt
        # keys < ctx + q0 are visible to every row of the tile: no mask
        full_end = ((ctx + q0) // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, qpos, 0, full_end,
                                    seq_len, qk_scale, stride_c_slot, offs_d, d_mask,
                                    BS, BLOCK_N, False, PREC)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, qpos, full_end, kv_end,
                                    seq_len, qk_scale, stride_c_slot, offs_d, d_mask,
                                    BS, BLOCK_N, True, PREC)
        if IS_FP8:
            acc = acc * tl.load(v_scale_ptr)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int = 2) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] flat varlen batch; returns the same shape in q's dtype.
    Query rows outside every sequence (padding past query_start_loc[-1]) are left unwritten."""
    T, Hq, D = q.shape
    _, _, BS, Hkv, Dc = kv_cache.shape
    S = seq_lens.shape[0]
    if Dc != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} incompatible with kv_cache {tuple(kv_cache.shape)}")
    if query_start_loc.shape[0] != S + 1 or block_tables.shape[0] < S:
        raise ValueError("query_start_loc must have num_seqs + 1 entries, block_tables num_seqs rows")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dim")
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV cache needs k_scale and v_scale")
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    G = Hq // Hkv
    G_PAD = triton.next_power_of_2(G)
    D_PAD = triton.next_power_of_2(D)
    if block_m is None:
        block_m = 128 if D_PAD <= 64 else 64
    if block_n is None:
        block_n = 64 if D_PAD <= 128 else 32
    block_m = max(block_m, G_PAD, 16)  # >= 16 rows for tl.dot, >= 1 token per tile
    block_q = max(1, block_m // G_PAD)
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    ks = k_scale if is_fp8 else seq_lens
    vs = v_scale if is_fp8 else seq_lens
    grid = (T // block_q + S, Hkv)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, ks, vs, out, float(scale), S,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BS=BS, BLOCK_Q=block_q, BLOCK_N=block_n,
        IS_FP8=is_fp8, PREC=None if is_fp8 else dot_precision(torch.float32 if upcast_dots(q.dtype) else q.dtype),
        UPCAST=upcast_dots(q.dtype), num_warps=num_warps, num_stages=num_stages)
    return out
