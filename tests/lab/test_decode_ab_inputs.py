"""The attention benchmark's inputs are in the layout the kernel reads: the Triton decode kernel
on lab.decode_ab's inputs matches the torch reference over the same cache (a [blocks, 2, ...]
cache, which the benchmark once built, makes the kernel read other bytes than the reference)."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from lab.decode_ab import BS, _attn_inputs  # noqa: E402
from engine.kernels.decode_attention import paged_decode_attention  # noqa: E402
from engine.kernels.reference import paged_attention_torch  # noqa: E402


def test_attention_bench_inputs_match_the_reference(device):
    torch.manual_seed(0)
    batch, ctx = 3, 40
    q, cache, bt, lens, new_kv = _attn_inputs(batch, ctx, device=device, hq=4, hkv=2, d=32)
    assert cache.shape == (2, batch * -(-(ctx + 1) // BS) + 1, BS, 2, 32)
    assert int(new_kv[5].max()) < cache.shape[1] * BS  # the new token's slots lie in the cache
    out = paged_decode_attention(q, cache, bt, lens, 32 ** -0.5)
    meta = SimpleNamespace(block_tables=bt, seq_lens_cpu=lens.tolist(),
                           query_start_loc_cpu=list(range(batch + 1)))
    ref = paged_attention_torch(q, cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
