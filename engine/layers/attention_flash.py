"""flash-attn backend: flash_attn_with_kvcache (decode) / flash_attn_varlen_func (mixed) on the
paged cache through block_table. Import of flash_attn is lazy: constructing the backend
without it raises a clear error; CPU installs never need it.

NOTE: upstream flash-attn 2 pages must hold a multiple of 256 tokens (block_size % 256 == 0)
and it has no fp8 KV cache; both are checked per call with a clear error (use 'triton').
"""
from __future__ import annotations

import torch

from engine.kernels.kv_write import write_kv
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVScales


def _import_flash_attn():
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise RuntimeError(
            "attention backend 'flash_attn' needs the flash-attn package (pip install flash-attn, "
            "CUDA only); use attention_backend='triton' or 'torch' instead") from e
    return flash_attn_with_kvcache, flash_attn_varlen_func


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, kernels)
        self._with_kvcache, self._varlen = _import_flash_attn()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if kv_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("flash_attn backend has no fp8 KV cache support; use 'triton'")
        if kv_cache.shape[2] % 256:
            raise ValueError(f"flash_attn paged KV needs block_size % 256 == 0, got "
                             f"{kv_cache.shape[2]}; use 'triton'")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, d]
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=meta.block_tables, softmax_scale=self.scale,
                                     causal=True)
            return out.squeeze(1)
        # bottom-right aligned causal mask (flash-attn >= 2.1) == queries at the context's end
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        T = int(meta.query_start_loc_cpu[-1]) if meta.query_start_loc_cpu else q.shape[0]
        out = torch.empty_like(q)
        out[:T] = self._varlen(q[:T], k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                               cu_seqlens_k=cu_k, max_seqlen_q=meta.max_query_len,
                               max_seqlen_k=meta.max_seq_len, softmax_scale=self.scale,
                               causal=True, block_table=meta.block_tables)
        return out
