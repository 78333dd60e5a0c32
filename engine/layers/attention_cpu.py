"""Paged attention for the torch backend on CPU: every decode row of a step in one batched
product, prompt rows one sequence at a time. Same results as paged_attention_torch (the
reference), without its per-sequence host loop over decode rows.

Decode rows (one query token each): their contexts are gathered from the cache in one
index_select per layer into [n, Lp * Hkv, D] (Lp = the longest context in whole blocks; K and V
together), and each row attends with ALL its Hq query heads against ALL Lp * Hkv (token, kv-head)
keys under one additive mask that keeps, for query head h, the keys of kv head h // (Hq / Hkv) at
positions < seq_len. The GQA grouping costs Hkv x the score FLOPs (small at decode) and saves
the repeat_interleave / transpose copies: both batched matmuls read contiguous operands.

Prompt rows: prompt chunks with no cached context (the whole context is this step's K/V, and
the cache holds them in their own dtype) attend over the k / v they were given, without reading
the cache back, prompts of similar length batched into one padded causal SDPA call; a chunk
after cached tokens gathers its context like the reference (SDPA with grouped-query heads).

The per-step plan (gather slots, mask, row split) is built once and reused by every layer
(AttentionMetadata.cpu_plan).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CpuAttentionPlan:
    decode_rows: torch.Tensor | None  # [n] long: decode rows' flat query rows (None: all rows)
    num_decode: int  # rows in decode_rows (with native: the short prompts' rows as well)
    blocks: torch.Tensor | None  # [n * Lp / bs] long: cache blocks of the decode rows' contexts
    mask: torch.Tensor | None  # [n, Hq, Lp * Hkv] additive (0 / -inf) in the compute dtype
    padded_len: int  # Lp
    # prompt rows: (q start, q end, context length, row index in the batch)
    prompt_rows: list[tuple[int, int, int, int]]
    # the C kernel's inputs (attention_cpu_native.py) in place of blocks / mask: its rows' block
    # tables (int32 [n, >= blocks]) and context lengths (int32 [n])
    native: object | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


def build_plan(meta, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
               device: torch.device, native=None) -> CpuAttentionPlan:
    """native: an attention_cpu_native.NativeDecode for the decode rows and the short prompts'
    rows (None: torch ops)."""
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    sl = meta.seq_lens_cpu or meta.seq_lens.tolist()
    bs = meta.block_size
    dec, prompts = [], []
    for i in range(len(sl)):
        ql = qsl[i + 1] - qsl[i]
        if ql == 1:
            dec.append(i)
        elif ql > 1:
            prompts.append((qsl[i], qsl[i + 1], sl[i], i))
    if native is not None:
        return _native_plan(meta, qsl, sl, dec, prompts, native, device)
    if not dec:
        return CpuAttentionPlan(None, 0, None, None, 0, prompts)
    lens = [sl[i] for i in dec]
    nblk = -(-max(lens) // bs)
    lp = nblk * bs
    all_rows = len(dec) == len(sl)
    idx = None if all_rows else torch.tensor(dec, dtype=torch.long, device=device)
    bt = meta.block_tables[:, :nblk] if all_rows else meta.block_tables.index_select(0, idx)[:, :nblk]
    q_rows = None if all_rows else torch.tensor([qsl[i] for i in dec], dtype=torch.long, device=device)
    t = torch.arange(lp, device=device)
    ok_pos = t[None, :] < torch.tensor(lens, device=device)[:, None]  # [n, Lp]
    group = num_heads // num_kv_heads
    same_head = (torch.arange(num_heads, device=device)[:, None] // group
                 == torch.arange(num_kv_heads, device=device)[None, :])  # [Hq, Hkv]
    ok = ok_pos[:, None, :, None] & same_head[None, :, None, :]  # [n, Hq, Lp, Hkv]
    mask = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
    return CpuAttentionPlan(q_rows, len(dec), bt.reshape(-1).long(),
                            mask.view(len(dec), num_heads, lp * num_kv_heads), lp, prompts)


# prompt chunks whose context is at most this many tokens attend row by row in the C kernel
# (each query row a decode row over its causal prefix, read in place from the cache): 2.9x
# faster for 32 prompts of 39 tokens, even at 256; longer ones through SDPA, whose tiled kernel
# re-reads K/V less (python -m bench.cpu_attention)
NATIVE_PROMPT_MAX_CTX = 160


def _native_plan(meta, qsl, sl, dec, prompts, native, device) -> CpuAttentionPlan:
    """Decode rows and short prompts' rows as one list of (query row, context length, sequence)
    for the C kernel; long prompts stay for the torch path."""
    rest = [p for p in prompts if p[2] > NATIVE_PROMPT_MAX_CTX]
    mine = [p for p in prompts if p[2] <= NATIVE_PROMPT_MAX_CTX]
    if not dec and not mine:
        return CpuAttentionPlan(None, 0, None, None, 0, rest)
    rows, lens, seqs = [qsl[i] for i in dec], [sl[i] for i in dec], list(dec)
    for qs, qe, ctx, i in mine:  # query row j of a chunk sits at position ctx - ql + j
        rows.extend(range(qs, qe))
        lens.extend(range(ctx - (qe - qs) + 1, ctx + 1))
        seqs.extend([i] * (qe - qs))
    nblk = -(-max(lens) // meta.block_size)
    in_order = seqs == list(range(len(sl))) and rows == list(range(len(rows)))
    if in_order:  # a pure decode step: rows 0..n-1 are sequences 0..n-1
        bt, q_rows = meta.block_tables[:, :nblk], None
    else:
        bt = meta.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=device))[:, :nblk]
        q_rows = torch.tensor(rows, dtype=torch.long, device=device)
    return CpuAttentionPlan(q_rows, len(rows), None, None, 0, rest, native,
                            bt.to(torch.int32), torch.tensor(lens, dtype=torch.int32))


# a batch of fresh prompts is padded to its longest: padding at most this share of the real rows
PAD_SLACK = 0.3


def fresh_groups(rows: list[tuple[int, int, int, int]]) -> list[list[tuple[int, int, int, int]]]:
    """Fresh prompt rows (no cached context) -> groups attended in one padded call: by length,
    each grown while its padded size stays within (1 + PAD_SLACK) x its real rows."""
    groups: list[list] = []
    total = 0
    for r in sorted(rows, key=lambda r: r[1] - r[0]):
        n = r[1] - r[0]
        if groups and (len(groups[-1]) + 1) * n <= (1 + PAD_SLACK) * (total + n):
            groups[-1].append(r)
            total += n
        else:
            groups.append([r])
            total = n
    return groups


def _fresh_prompts(q, k, v, out, rows, scale: float, cdt) -> None:
    """Causal attention of prompts whose whole context is this step's K/V, one SDPA call for
    the group: right-padded to the longest, so a real query row's causal window holds real keys
    only; the padded rows' outputs are dropped. K/V heads are repeated to the query heads: SDPA's
    fused CPU kernel takes no GQA (enable_gqa runs the unfused math, ~3x slower here)."""
    hq, hkv = q.shape[1], k.shape[1]
    pad = torch.nn.utils.rnn.pad_sequence
    qb = pad([q[qs:qe] for qs, qe, _, _ in rows], batch_first=True).to(cdt).transpose(1, 2)
    kb = pad([k[qs:qe] for qs, qe, _, _ in rows], batch_first=True).to(cdt).transpose(1, 2)
    vb = pad([v[qs:qe] for qs, qe, _, _ in rows], batch_first=True).to(cdt).transpose(1, 2)
    if hq != hkv:
        kb, vb = kb.repeat_interleave(hq // hkv, 1), vb.repeat_interleave(hq // hkv, 1)
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # [B, Hq, L, D]
    o = o.transpose(1, 2).to(q.dtype)
    for b, (qs, qe, _, _) in enumerate(rows):
        out[qs:qe] = o[b, :qe - qs]


def paged_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta, scale: float, plan: CpuAttentionPlan) -> torch.Tensor:
    """q [T, Hq, D], k / v [T, Hkv, D] (this step's, already in the cache) -> [T, Hq, D]."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    out = torch.empty_like(q)
    cdt = torch.float32
    if plan.num_decode and plan.native is not None:  # decode rows and short prompts' rows
        plan.native(q, kv_cache, out, plan.decode_rows, plan.block_tables, plan.seq_lens, scale)
    elif plan.num_decode:
        n, lp = plan.num_decode, plan.padded_len
        nb, bs = kv_cache.shape[1], kv_cache.shape[2]
        # NOTE: one gather for K and V by whole blocks (rows of bs * Hkv * D; a row per token
        # took 1.26x as long: 49 vs 39 us, SmolLM2, 8 rows x 112 tokens, 2 threads):
        # [2, n * Lp / bs, bs * Hkv * D] is [2, n * Lp, Hkv * D]
        kv = kv_cache.view(2, nb, bs * hkv * d).index_select(1, plan.blocks)
        if kv.dtype != cdt:
            kv = kv.to(cdt)
        kk = kv[0].view(n, lp * hkv, d)
        vv = kv[1].view(n, lp * hkv, d)
        qd = q if plan.decode_rows is None else q.index_select(0, plan.decode_rows)
        s = torch.baddbmm(plan.mask, qd.to(cdt), kk.transpose(1, 2), alpha=scale)  # [n, Hq, Lp*Hkv]
        o = torch.bmm(s.softmax(dim=-1), vv).to(q.dtype)  # [n, Hq, D]
        if plan.decode_rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, plan.decode_rows, o)
    # fresh: no cached context, and k / v as the cache stores them (no rounding skipped)
    fresh_ok = k.dtype == kv_cache.dtype
    fresh, cached = [], []
    for r in plan.prompt_rows:
        (fresh if fresh_ok and r[2] == r[1] - r[0] else cached).append(r)
    for group in fresh_groups(fresh):
        _fresh_prompts(q, k, v, out, group, scale, cdt)
    if cached:
        from engine.layers.attention import gather_kv_torch
    for qs, qe, ctx, i in cached:
        ql = qe - qs
        qi = q[qs:qe].to(cdt).transpose(0, 1)  # [Hq, ql, D]
        ki, vi = gather_kv_torch(kv_cache, meta.block_tables[i], ctx, cdt)
        ki = ki.to(cdt).transpose(0, 1)  # [Hkv, ctx, D]
        vi = vi.to(cdt).transpose(0, 1)
        # query row j sits at position ctx - ql + j; it sees keys 0 .. ctx - ql + j
        pos_q = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1).to(q.dtype)
    return out
