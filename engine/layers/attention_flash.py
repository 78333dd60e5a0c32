"""flash-attn backend over the paged cache: FlashAttention-4 (`flash_attn.cute`, the CuTe-DSL
build from the `flash-attn-4` wheel; Hopper and Blackwell) when it imports, else flash-attn 2.
Imports are lazy: constructing the backend without either raises a clear error; CPU installs
never need them. Compare it with the Triton backend on a GPU with
`python bench/attention_backends_gpu.py`.

FA4 takes the cache as [num_pages, page_size, kv_heads, d] with a page table and per-sequence
used lengths (`seqused_k`), so any page size works (pages that hold one key tile load by TMA,
others by a gather). flash-attn 2's pages must hold a multiple of 256 tokens, which the engine's
block sizes (16 / 32) never are, so with flash-attn 2 alone every call raises (use 'triton').
Neither has an fp8 KV cache path here (checked per call with a clear error).
"""
from __future__ import annotations

import torch

from engine.kernels.kv_write import write_kv
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.layers.attention import AttentionBackend, AttentionMetadata, KVScales


def import_flash(prefer: str = "auto"):
    """-> (implementation name, callables) for 'fa4' or 'fa2'; prefer 'auto' tries FA4 first."""
    errors = []
    for impl in (("fa4", "fa2") if prefer == "auto" else (prefer,)):
        try:
            if impl == "fa4":
                from flash_attn.cute import flash_attn_varlen_func

                return "fa4", (flash_attn_varlen_func,)
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            return "fa2", (flash_attn_with_kvcache, flash_attn_varlen_func)
        except ImportError as e:  # a missing package or a missing dependency of one
            errors.append(f"{impl}: {e}")
    raise RuntimeError(
        "attention backend 'flash_attn' needs flash-attn-4 (pip install 'flash-attn-4[cu13]', "
        "Hopper / Blackwell) or flash-attn 2 (CUDA only); use attention_backend='triton' or "
        "'torch' instead (" + "; ".join(errors) + ")")


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS, prefer: str = "auto"):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, kernels)
        self.impl, self._fns = import_flash(prefer)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if kv_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("flash_attn backend has no fp8 KV cache support; use 'triton'")
        if self.impl == "fa2" and kv_cache.shape[2] % 256:
            raise ValueError(f"flash-attn 2 paged KV needs block_size % 256 == 0, got "
                             f"{kv_cache.shape[2]}; install flash-attn-4 or use 'triton'")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, d]
        # rows past the last query (graph padding) are left as they are: nothing reads them
        T = int(meta.query_start_loc_cpu[-1]) if meta.query_start_loc_cpu else q.shape[0]
        out = torch.empty_like(q)
        if self.impl == "fa4":
            # causal masks align bottom-right: queries are the last tokens of their context
            out[:T] = self._fns[0](q[:T], k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                                   seqused_k=meta.seq_lens, page_table=meta.block_tables,
                                   max_seqlen_q=meta.max_query_len,
                                   max_seqlen_k=meta.max_seq_len,
                                   softmax_scale=self.scale, causal=True)[0]
            return out
        with_kvcache, varlen = self._fns
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                block_table=meta.block_tables, softmax_scale=self.scale,
                                causal=True).squeeze(1)
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        out[:T] = varlen(q[:T], k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                         cu_seqlens_k=cu_k, max_seqlen_q=meta.max_query_len,
                         max_seqlen_k=meta.max_seq_len, softmax_scale=self.scale,
                         causal=True, block_table=meta.block_tables)
        return out
