from dataclasses import replace

import pytest
import torch

from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.options import KernelOptions
from engine.kernels.reference import paged_attention_torch

from ._util import make_batch


@pytest.mark.parametrize("hkv,gqa,d,bs", [(2, 1, 64, 16), (1, 4, 128, 32), (1, 8, 64, 16),
                                          (2, 4, 64, 32)])
@pytest.mark.parametrize("num_splits,prefetch", [(1, False), (3, False), (2, True), (5, True)])
def test_decode_matches_reference(hkv, gqa, d, bs, num_splits, prefetch, device):
    seq_lens = [1, 17, 33, 70] if bs == 16 else [5, 32, 65]
    kv, meta = make_batch(seq_lens, [1] * len(seq_lens), bs, hkv, d, torch.float32, device, seed=gqa)
    q = torch.randn(len(seq_lens), hkv * gqa, d, device=device)
    scale = d ** -0.5
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, scale,
                                 num_splits=num_splits, block_n=16, prefetch=prefetch)
    ref = paged_attention_torch(q, kv, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_default_splits(dtype, device):
    seq_lens = [9, 48, 100]
    kv, meta = make_batch(seq_lens, [1, 1, 1], 16, 2, 64, dtype, device)
    q = torch.randn(3, 8, 64, device=device).to(dtype)
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125)
    ref = paged_attention_torch(q, kv, meta, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_decode_fp8(device):
    seq_lens = [20, 47]
    kv, meta = make_batch(seq_lens, [1, 1], 16, 2, 64, torch.bfloat16, device,
                          kv_dtype=torch.float8_e4m3fn)
    q = torch.randn(2, 8, 64, device=device).to(torch.bfloat16)
    ks, vs = torch.tensor(0.7, device=device), torch.tensor(1.3, device=device)
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125, ks, vs,
                                 num_splits=2, block_n=16, prefetch=True)
    ref = paged_attention_torch(q, kv, meta, 0.125, ks, vs)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_decode_empty_sequence_gives_zeros(device):
    # seq_len 0 = CUDA-graph padding row: must be finite zeros, not NaN
    kv, meta = make_batch([0, 20], [0, 1], 16, 1, 64, torch.float32, device)
    q = torch.randn(2, 1, 64, device=device)
    for splits in (1, 2):
        out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125,
                                     num_splits=splits, block_n=16)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        meta2 = make_batch([20], [1], 16, 1, 64, torch.float32, device)[1]
        ref = paged_attention_torch(q[1:], kv, type(meta2)(**{**meta2.__dict__,
                                    "block_tables": meta.block_tables[1:]}), 0.125)
        torch.testing.assert_close(out[1:], ref, atol=2e-5, rtol=2e-5)


def test_choose_num_splits_is_shape_only_and_bounded():
    from engine.kernels.decode_tiles import choose_num_splits

    cpu = torch.device("cpu")  # nominal 8 SMs
    assert choose_num_splits(1, 1, 256, 16, 64, cpu) > 1       # tiny batch, long context: split
    assert choose_num_splits(64, 8, 256, 16, 64, cpu) == 1      # GPU already full: no split
    assert choose_num_splits(1, 1, 2, 16, 64, cpu) == 1         # short context: nothing to split
    assert 1 <= choose_num_splits(1, 1, 10**6, 16, 16, cpu) <= 64


@pytest.mark.parametrize("seqs,heads", [(1, 1), (1, 8), (2, 3), (4, 2), (16, 1)])
def test_split_rule_keeps_one_wave_and_a_tile_per_split(seqs, heads):
    """At most programs_per_sm x SMs programs (one wave) while a split is possible, and never
    a split without a whole KV tile (CPU: a nominal 8 SMs)."""
    from engine.kernels.decode_tiles import choose_num_splits

    cpu = torch.device("cpu")
    for max_blocks in (1, 7, 64, 512):
        sp = choose_num_splits(seqs, heads, max_blocks, 16, 128, cpu, programs_per_sm=2)
        tiles = -(-max_blocks * 16 // 128)
        assert 1 <= sp <= tiles
        if sp > 1:
            assert seqs * heads * sp <= 2 * 8
        if tiles >= 16:  # enough context: the wave is filled as far as whole splits allow
            assert seqs * heads * (sp + 1) > 2 * 8 or sp == 64


def test_batch_tile_only_where_the_default_tile_would_not_split():
    import engine.kernels.decode_tiles as da

    cpu = torch.device("cpu")  # nominal 8 SMs: the default tile's wave is 2 x 8 = 16 programs
    assert da.default_tile(False, 128, 15, cpu) is da.TILE_16BIT_FEW  # few 128-wide pairs
    assert da.default_tile(False, 64, 15, cpu) is da.TILE_16BIT
    assert da.default_tile(False, 128, 16, cpu) is da.TILE_16BIT_BATCH
    assert da.default_tile(False, 64, 512, cpu) is da.TILE_16BIT_BATCH_NARROW
    assert da.default_tile(True, 128, 512, cpu) is da.TILE_FP8
    assert da.default_tile(False, 256, 512, cpu) is da.TILE_WIDE_HEAD
    assert da.default_tile(False, 128, 0, cpu) is da.TILE_16BIT  # pairs unknown
    no_batch = KernelOptions(batch_tile=False)
    assert da.default_tile(False, 128, 512, cpu, no_batch) is da.TILE_16BIT
    assert da.default_tile(False, 128, 15, cpu, replace(no_batch, few_tile=False)) is da.TILE_16BIT


def test_tile_16bit_option_replaces_the_small_batch_tile_and_its_wave():
    import engine.kernels.decode_tiles as da

    cpu = torch.device("cpu")
    tile = da.DecodeTile(32, 4, 2, True, programs_per_sm=4, min_tiles_per_split=4)
    opts = KernelOptions(tile_16bit=tile, few_tile=False)
    assert da.default_tile(False, 128, 15, cpu, opts) is tile
    assert da.default_tile(False, 128, 16, cpu, opts) is tile  # its wave is 4 x 8 pairs
    assert da.default_tile(False, 128, 32, cpu, opts) is da.TILE_16BIT_BATCH


@pytest.mark.parametrize("few_tile", [False, True])
def test_decode_few_tile_matches_reference(few_tile, device):
    """Few sequences of 128-wide heads take TILE_16BIT_FEW (64-token tiles, its launch cut):
    the same results as the reference, with and without it."""
    import engine.kernels.decode_tiles as da

    opts = KernelOptions(few_tile=few_tile)
    seq_lens = [1, 63, 64, 65, 200]
    kv, meta = make_batch(seq_lens, [1] * len(seq_lens), 16, 2, 128, torch.bfloat16, device)
    q = torch.randn(len(seq_lens), 4, 128, device=device).to(torch.bfloat16)
    assert (da.default_tile(False, 128, len(seq_lens) * 2, q.device, opts) is da.TILE_16BIT_FEW) == few_tile
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.088, kernels=opts)
    ref = paged_attention_torch(q, kv, meta, 0.088)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch_tile", [False, True])
def test_decode_batch_tile_matches_reference(batch_tile, device, monkeypatch):
    """Enough (sequence, KV head) pairs for the batch tile on a nominal 8 SMs (16+; the GPU's
    SM count is patched to that), with and without it: same results as the reference."""
    import engine.kernels.decode_tiles as da

    opts = KernelOptions(batch_tile=batch_tile)
    monkeypatch.setattr(da, "num_sms", lambda _device: 8)
    seq_lens = [1, 17, 64, 65, 130, 3, 40, 77]
    kv, meta = make_batch(seq_lens, [1] * len(seq_lens), 16, 2, 64, torch.bfloat16, device)
    q = torch.randn(len(seq_lens), 4, 64, device=device).to(torch.bfloat16)
    want = da.TILE_16BIT_BATCH_NARROW if batch_tile else da.TILE_16BIT
    assert da.default_tile(False, 64, len(seq_lens) * 2, q.device, opts) is want
    out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125, kernels=opts)
    ref = paged_attention_torch(q, kv, meta, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,gqa,num_splits,prefetch", [(2, 4, 1, False), (1, 3, 3, True), (4, 2, 2, False)])
def test_fused_rope_append_matches_two_kernels(dtype, hkv, gqa, num_splits, prefetch, device):
    """new_kv: rotary + KV append inside the decode kernel == rope_write_kv, then the kernel;
    padding rows (slot -1, seq_len 0) write nothing and give zeros."""
    from engine.kernels.rope_kv_write import rope_write_kv

    g = torch.Generator().manual_seed(hkv * 100 + gqa * 10 + num_splits)
    d, bs, S = 32, 16, 4
    hq = hkv * gqa
    lens = torch.tensor([37, 1, 16, 0], dtype=torch.int32)  # new token included; last: padding
    nblk = 4
    cache = torch.randn(2, S * nblk + 1, bs, hkv, d, generator=g).to(dtype).to(device)
    bt = torch.randperm(S * nblk, generator=g)[:S * nblk].view(S, nblk).to(torch.int32).to(device)
    pos = (lens - 1).clamp(min=0)
    slots = torch.tensor([int(bt[i, p // bs]) * bs + int(p) % bs for i, p in enumerate(pos.tolist())])
    slots[3] = -1
    qkv = torch.randn(S, hq + 2 * hkv, d, generator=g).to(dtype).to(device)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = f.cos().to(device), f.sin().to(device)
    idx = torch.arange(S, device=device)
    slots, lens = slots.to(device), lens.to(device)
    # the two kernels
    q2, cache2 = q.clone(), cache.clone()
    rope_write_kv(idx, q2, k.clone(), v, cos, sin, cache2, slots)
    want = paged_decode_attention(q2, cache2, bt, lens, d ** -0.5, num_splits=num_splits, prefetch=prefetch)
    # fused
    q0 = q.clone()
    got = paged_decode_attention(q, cache, bt, lens, d ** -0.5, num_splits=num_splits, prefetch=prefetch,
                                 new_kv=(k, v, cos, sin, idx, slots))
    assert torch.equal(q, q0), "q must be left un-rotated"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache.float(), cache2.float(), **tol)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.count_nonzero(got[3]) == 0


def test_fused_rope_append_rejects_bad_shapes(device):
    q = torch.zeros(2, 4, 32, device=device)
    cache = torch.zeros(2, 4, 16, 2, 32, device=device)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    k = torch.zeros(2, 2, 32, device=device)
    cs = torch.zeros(2, 16, device=device)
    idx = torch.arange(2, device=device)
    with pytest.raises(ValueError, match="k .* are not"):
        paged_decode_attention(q, cache, bt, lens, 1.0, new_kv=(k[:, :1], k[:, :1], cs, cs, idx, idx))
    with pytest.raises(ValueError, match="whole head_dim"):
        paged_decode_attention(q, cache, bt, lens, 1.0, new_kv=(k, k, cs[:, :8], cs[:, :8], idx, idx))
