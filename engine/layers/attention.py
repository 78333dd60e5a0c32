"""Attention over a paged KV cache: one metadata object, interchangeable backends.

KV cache layout (one tensor per layer, shared by every backend and by kvtransfer):
    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
    index 0 = K, 1 = V; token t of a sequence lives in block block_table[t // block_size],
    row t % block_size; its flat slot is block_id * block_size + t % block_size.
With kv_cache_dtype=fp8_e4m3 the tensor is float8_e4m3fn and `k_scale`/`v_scale` (per layer,
per tensor) convert: stored = value / scale, value = stored * scale.

A batch is flat: tokens of many sequences concatenated, prefill chunks and decodes mixed.
Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its context (cached
prefix + this step's tokens) is seq_lens[i] tokens long, so the query rows sit at positions
seq_lens[i] - q_len .. seq_lens[i] - 1 and attend causally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.options import DEFAULT_KERNELS, KernelOptions

FP8_MAX = 448.0


@dataclass
class AttentionMetadata:
    # [num_tokens] flat cache slot for each new token (-1 = padding, not written)
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32, padded with 0
    block_tables: torch.Tensor
    # [num_seqs] int32: context length including this step's tokens
    seq_lens: torch.Tensor
    # [num_seqs + 1] int32: prefix sum of query lengths
    query_start_loc: torch.Tensor
    # NOTE: exact in eager steps; under a CUDA graph they are frozen at capture as upper bounds
    # (the bucket's token count, max_model_len in whole blocks) and the host copies below are
    # None: a graph-safe backend uses them as bounds only (Triton ignores them)
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies (python lists) for backends that loop on the host (torch reference)
    seq_lens_cpu: list[int] | None = None
    query_start_loc_cpu: list[int] | None = None
    # True when every sequence has exactly one query token (pure decode step)
    is_decode_only: bool = False
    # the torch backend's per-step plan on CPU (engine/layers/attention_cpu.py): built by the
    # first layer's forward, reused by the others
    cpu_plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class KVScales:
    """Per-layer fp8 scales: calibrated from the first write (amax / FP8_MAX), then frozen.

    NOTE: a scale must never change once data is stored under it; exported blocks carry
    the scales so the importing side uses the same ones.
    """

    def __init__(self, num_layers: int, device: torch.device):
        self.k = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.v = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.calibrated = [False] * num_layers

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.calibrated[layer] or k.numel() == 0:
            return
        # headroom x2: later tokens may exceed the first batch's range
        self.k[layer] = (k.abs().amax().float() * 2.0 / FP8_MAX).clamp(min=1e-6)
        self.v[layer] = (v.abs().amax().float() * 2.0 / FP8_MAX).clamp(min=1e-6)
        self.calibrated[layer] = True


class AttentionBackend:
    """Interface every backend implements. `forward` writes this step's K/V into the cache,
    then attends; it returns [num_tokens, num_heads, head_dim] in q's dtype. `kernels`: the
    engine's KernelOptions, for the backends that launch our Triton kernels."""

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.kernels = kernels

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                     kv_cache: torch.Tensor, meta: AttentionMetadata,
                     kv_scales: KVScales | None = None) -> torch.Tensor:
        """forward() on un-rotated q / k: rope = (cos, sin, token_index) of this batch.
        Backends may fuse the rotation into their KV write (Triton does)."""
        from engine.layers.rotary import rotate_qk

        q, k = rotate_qk(q, k, *rope)
        return self.forward(layer, q, k, v, kv_cache, meta, kv_scales)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Reference KV write. k, v: [num_tokens, num_kv_heads, head_dim]."""
    nb, bs, hkv, d = kv_cache.shape[1:]
    flat = kv_cache.view(2, nb * bs, hkv, d)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    if kv_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() / k_scale).clamp(-FP8_MAX, FP8_MAX)
        v = (v.float() / v_scale).clamp(-FP8_MAX, FP8_MAX)
        # NOTE: index_copy_ has no fp8 kernel on CPU; copy the raw bytes instead
        flat[0].view(torch.uint8).index_copy_(0, slots, k.to(kv_cache.dtype).view(torch.uint8))
        flat[1].view(torch.uint8).index_copy_(0, slots, v.to(kv_cache.dtype).view(torch.uint8))
        return
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def gather_kv_torch(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                    dtype: torch.dtype, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference gather of one sequence's context: two [seq_len, num_kv_heads, head_dim]."""
    bs = kv_cache.shape[2]
    nblk = (seq_len + bs - 1) // bs
    blocks = block_table[:nblk].long()
    if kv_cache.dtype == torch.float8_e4m3fn:
        raw = kv_cache.view(torch.uint8)
        k = raw[0, blocks].flatten(0, 1)[:seq_len].view(torch.float8_e4m3fn)
        v = raw[1, blocks].flatten(0, 1)[:seq_len].view(torch.float8_e4m3fn)
    else:
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    if kv_cache.dtype == torch.float8_e4m3fn:
        return (k.float() * k_scale).to(dtype), (v.float() * v_scale).to(dtype)
    return k.to(dtype), v.to(dtype)


def paged_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference attention over the paged cache (after this step's K/V were written)."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], kv_cache.shape[3]
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    sl = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for i in range(len(sl)):
        qs, qe, L = qsl[i], qsl[i + 1], sl[i]
        ql = qe - qs
        if ql == 0:
            continue
        k, v = gather_kv_torch(kv_cache, meta.block_tables[i], L, torch.float32, k_scale, v_scale)
        qi = q[qs:qe].float().transpose(0, 1)  # [hq, ql, d]
        k = k.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [hq, L, d]
        v = v.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        if ql == 1:
            o = F.scaled_dot_product_attention(qi, k, v, scale=scale)
        else:
            # query row j sits at position L - ql + j; it sees keys 0 .. L - ql + j
            pos_q = torch.arange(L - ql, L, device=q.device)[:, None]
            pos_k = torch.arange(L, device=q.device)[None, :]
            mask = pos_k <= pos_q
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1).to(q.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    """Torch ops only, CPU and GPU. On CPU (fp32 / 16-bit KV) the decode rows of a step attend
    in one batched product (engine/layers/attention_cpu.py); elsewhere, and for fp8 KV, the
    reference (a host loop over sequences)."""

    name = "torch"

    def __init__(self, *args, cpu_decode=None, **kw):
        """cpu_decode: an attention_cpu_native.NativeDecode for the decode rows on CPU (None:
        torch ops)."""
        super().__init__(*args, **kw)
        self.cpu_decode = cpu_decode

    def forward(self, layer, q, k, v, kv_cache, meta, kv_scales=None):
        ks = vs = None
        if kv_cache.dtype == torch.float8_e4m3fn:
            assert kv_scales is not None, "fp8 KV cache needs scales"
            kv_scales.calibrate(layer, k, v)
            ks, vs = kv_scales.k[layer], kv_scales.v[layer]
        write_kv_torch(k, v, kv_cache, meta.slot_mapping, ks, vs)
        if q.device.type == "cpu" and ks is None:
            from engine.layers.attention_cpu import build_plan, paged_attention_cpu

            if meta.cpu_plan is None:
                nd = self.cpu_decode
                meta.cpu_plan = build_plan(meta, self.num_heads, self.num_kv_heads, torch.float32,
                                           q.device, nd if nd is not None and nd.supports(q, kv_cache) else None)
            return paged_attention_cpu(q, k, v, kv_cache, meta, self.scale, meta.cpu_plan)
        return paged_attention_torch(q, kv_cache, meta, self.scale, ks, vs)

