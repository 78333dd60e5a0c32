"""Triton attention backend: KV write + paged decode (flash-decoding) / varlen prefill kernels.

Same contract as TorchAttentionBackend.forward. CUDA-graph safe: no host syncs, no .tolist();
the grids depend only on tensor shapes (num_tokens, num_seqs, block_tables.shape).
"""
from __future__ import annotations

import torch

from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.kv_write import write_kv
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.rope_kv_write import rope_write_kv
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVScales


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # decode-only batches of at most fuse_decode_rope_max_seqs sequences: rotary + KV append
    # fused into the decode attention kernel, one launch per layer fewer: 0.2-1.4% faster 8B
    # steps at batches 16-64 (measure: python -m bench.engine_gpu, its rotary-fusion A/B)
    fuse_decode_rope = True
    fuse_decode_rope_max_seqs = 1 << 16

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        self._check_q(q)
        ks, vs = self._scales(layer, k, v, kv_cache, kv_scales)
        write_kv(k, v, kv_cache, meta.slot_mapping, ks, vs)
        return self._attend(q, kv_cache, meta, ks, vs)

    def forward_rope(self, layer, q, k, v, rope, kv_cache, meta, kv_scales=None):
        cos, sin, idx = rope
        fp8_uncalibrated = (kv_cache.dtype == torch.float8_e4m3fn and kv_scales is not None
                            and not kv_scales.calibrated[layer])
        if idx is None or 2 * cos.shape[1] != self.head_dim or fp8_uncalibrated:
            # NOTE: fp8 calibration reads the rotated k, so the first (calibrating) call of a
            # layer takes the unfused path
            return super().forward_rope(layer, q, k, v, rope, kv_cache, meta, kv_scales)
        self._check_q(q)
        if (self.fuse_decode_rope and meta.is_decode_only and q.shape[0] == meta.num_seqs
                and meta.num_seqs <= self.fuse_decode_rope_max_seqs
                and kv_cache.dtype != torch.float8_e4m3fn and self.head_dim & (self.head_dim - 1) == 0):
            # decode: rotary + KV append inside the attention kernel (one launch per layer)
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, self.scale,
                                          new_kv=(k, v, cos, sin, idx, meta.slot_mapping),
                                          kernels=self.kernels)
        ks, vs = self._scales(layer, k, v, kv_cache, kv_scales)
        rope_write_kv(idx, q, k, v, cos, sin, kv_cache, meta.slot_mapping, ks, vs, kernels=self.kernels)
        return self._attend(q, kv_cache, meta, ks, vs)

    def _check_q(self, q):
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]
        if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q {tuple(q.shape)} is not [T, {self.num_heads}, {self.head_dim}]")

    @staticmethod
    def _scales(layer, k, v, kv_cache, kv_scales):
        if kv_cache.dtype != torch.float8_e4m3fn:
            return None, None
        if kv_scales is None:
            raise ValueError("fp8 KV cache needs kv_scales")
        # NOTE: calibration happens once per layer (first write); later calls, and so any
        # CUDA-graph capture after warm-up, only read the frozen device scalars.
        kv_scales.calibrate(layer, k, v)
        return kv_scales.k[layer], kv_scales.v[layer]

    def _attend(self, q, kv_cache, meta, ks, vs):
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens,
                                          self.scale, ks, vs, kernels=self.kernels)
        return paged_prefill_attention(q, kv_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale, ks, vs)
