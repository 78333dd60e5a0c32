"""Random inputs for kernel tests (and GPU benchmarks): paged-KV batches, skinny-GEMM operands."""
from __future__ import annotations

import torch

from engine.layers.attention import AttentionMetadata


def make_batch(seq_lens: list[int], q_lens: list[int], block_size: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device, spare_blocks: int = 3, seed: int = 0,
               kv_dtype: torch.dtype | None = None):
    """Cache filled with random values (values beyond each context stay random too, so a
    kernel reading past seq_len shows up), blocks assigned in a shuffled order.
    Returns (kv_cache, meta); the new tokens' slots are the last q_len of each context."""
    g = torch.Generator().manual_seed(seed)
    nblk = [(L + block_size - 1) // block_size for L in seq_lens]
    total = sum(nblk) + spare_blocks
    perm = torch.randperm(total, generator=g)
    max_blocks = max(max(nblk, default=1), 1) + 1  # one padding column
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, off = [], 0
    for i, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        ids = perm[off:off + nblk[i]]
        off += nblk[i]
        bt[i, :nblk[i]] = ids.to(torch.int32)
        for p in range(L - ql, L):
            slots.append(int(ids[p // block_size]) * block_size + p % block_size)
    kv = torch.randn(2, total, block_size, num_kv_heads, head_dim, generator=g)
    kv = kv.to(kv_dtype or dtype).to(device)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=bt.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size,
        seq_lens_cpu=list(seq_lens), query_start_loc_cpu=qsl,
        is_decode_only=all(ql == 1 for ql in q_lens))
    return kv, meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def gemm_data(m: int, n: int, k: int, dtype: torch.dtype, device, seed: int, silu: bool = False):
    """(x [m, k], weight [n or 2n, k], norm weight [k], residual [m, n], bias [n]), seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device)
    res = torch.randn(m, n, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, nw, res, b
