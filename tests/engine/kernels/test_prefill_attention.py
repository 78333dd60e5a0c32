import pytest
import torch

from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.reference import paged_attention_torch

from ._util import make_batch

# (seq_lens, q_lens): fresh prompts, cached prefixes, decode rows, block-boundary lengths
CASES = {
    "fresh": ([7, 16, 33], [7, 16, 33]),
    "prefix": ([40, 31, 64], [9, 31, 1]),
    "mixed": ([1, 50, 17, 32], [1, 18, 1, 32]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("hkv,gqa,d,bs", [(2, 1, 64, 16), (1, 4, 128, 32), (1, 8, 64, 16)])
def test_prefill_matches_reference(case, hkv, gqa, d, bs, device):
    seq_lens, q_lens = CASES[case]
    kv, meta = make_batch(seq_lens, q_lens, bs, hkv, d, torch.float32, device, seed=gqa)
    T = sum(q_lens)
    q = torch.randn(T, hkv * gqa, d, device=device)
    scale = d ** -0.5
    out = paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  scale, block_m=16, block_n=16)
    ref = paged_attention_torch(q, kv, meta, scale)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_prefill_default_tiles_bf16(device):
    seq_lens, q_lens = [70, 5, 129], [70, 2, 40]
    kv, meta = make_batch(seq_lens, q_lens, 16, 2, 64, torch.bfloat16, device)
    q = torch.randn(sum(q_lens), 8, 64, device=device).to(torch.bfloat16)
    out = paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    ref = paged_attention_torch(q, kv, meta, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_prefill_fp8(device):
    seq_lens, q_lens = [30, 21], [12, 21]
    kv, meta = make_batch(seq_lens, q_lens, 16, 1, 64, torch.bfloat16, device,
                          kv_dtype=torch.float8_e4m3fn)
    q = torch.randn(33, 4, 64, device=device).to(torch.bfloat16)
    ks, vs = torch.tensor(0.6, device=device), torch.tensor(1.7, device=device)
    out = paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  0.125, ks, vs, block_m=16, block_n=16)
    ref = paged_attention_torch(q, kv, meta, 0.125, ks, vs)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_prefill_zero_length_sequence_and_padding_rows(device):
    # a sequence with no query rows in the middle, and padded token rows past qsl[-1]
    seq_lens, q_lens = [20, 8, 9], [20, 0, 3]
    kv, meta = make_batch(seq_lens, q_lens, 16, 1, 64, torch.float32, device)
    q = torch.randn(23 + 4, 2, 64, device=device)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                            out=out, block_m=16, block_n=16)
    ref = paged_attention_torch(q[:23], kv, meta, 0.125)
    torch.testing.assert_close(out[:23], ref, atol=3e-5, rtol=3e-5)
    assert torch.all(out[23:] == 7.0)


@pytest.mark.parametrize("gqa,block_m", [(1, 16), (4, None)])
def test_prefill_graph_padding_matches_unpadded(gqa, block_m, device):
    """The batch a prefill CUDA graph sees (engine/graphs_prefill.py): bucket > tokens (rows
    outside every sequence), trailing empty sequences (q_len 0, seq_len 0) whose block-table rows
    hold garbage, and stale block ids past each real context. Real rows must equal the unpadded
    call bit for bit (same tiles, same order), padding rows stay unwritten."""
    seq_lens, q_lens = [40, 31, 64, 9], [9, 31, 1, 9]
    hkv, d, bs = 2, 64, 16
    kv, meta = make_batch(seq_lens, q_lens, bs, hkv, d, torch.float32, device, seed=5)
    n, s = sum(q_lens), len(q_lens)
    T, S = 80, 8  # the bucket: tokens, sequences
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, hkv * gqa, d, generator=g).to(device)
    tiles = dict(block_m=block_m, block_n=16) if block_m else {}
    unpadded = paged_prefill_attention(q[:n], kv, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, 0.125, **tiles)
    qsl = torch.full((S + 1,), n, dtype=torch.int32)
    qsl[:s + 1] = meta.query_start_loc.cpu()
    sl = torch.zeros(S, dtype=torch.int32)
    sl[:s] = meta.seq_lens.cpu()
    W = meta.block_tables.shape[1] + 2
    bt = torch.randint(0, kv.shape[1], (S, W), dtype=torch.int32, generator=g)  # stale ids
    for i, L in enumerate(seq_lens):
        k = -(-L // bs)
        bt[i, :k] = meta.block_tables[i, :k].cpu()
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, kv, bt.to(device), sl.to(device), qsl.to(device), 0.125, out=out,
                            **tiles)
    assert torch.equal(out[:n], unpadded), (out[:n] - unpadded).abs().max().item()
    assert torch.all(out[n:] == 7.0), "a padding token row outside every sequence was written"
    ref = paged_attention_torch(q[:n], kv, meta, 0.125)
    torch.testing.assert_close(out[:n], ref, atol=3e-5, rtol=3e-5)
