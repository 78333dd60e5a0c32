"""Triton attention backend: KV write + paged decode (flash-decoding) / varlen prefill kernels.

Same contract as TorchAttentionBackend.forward. CUDA-graph safe: no host syncs, no .tolist();
the grids depend only on tensor shapes (num_tokens, num_seqs, block_tables.shape).
"""
from __future__ import annotations

import torch

from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.kv_write import write_kv
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVScales


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]
        if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q {tuple(q.shape)} is not [T, {self.num_heads}, {self.head_dim}]")
        ks = vs = None
        if kv_cache.dtype == torch.float8_e4m3fn:
            if kv_scales is None:
                raise ValueError("fp8 KV cache needs kv_scales")
            # NOTE: calibration happens once per layer (first write); later calls, and so any
            # CUDA-graph capture after warm-up, only read the frozen device scalars.
            kv_scales.calibrate(layer, k, v)
            ks, vs = kv_scales.k[layer], kv_scales.v[layer]
        write_kv(k, v, kv_cache, meta.slot_mapping, ks, vs)
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens,
                                          self.scale, ks, vs)
        return paged_prefill_attention(q, kv_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale, ks, vs)
