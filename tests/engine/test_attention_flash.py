"""FlashAttentionBackend's FA4 path against the torch reference backend, on CPU, with a stand-in
`flash_attn.cute` that computes what FA4 documents for `flash_attn_varlen_func` (varlen queries,
paged K/V through `page_table`, `seqused_k`, bottom-right causal mask, GQA; returns (out, lse)).
It checks the adapter's arguments; tests/gpu/test_flash_attention.py runs the real kernels."""
import sys
import types

import pytest
import torch

from engine.kernels.reference import write_kv_ref
from engine.layers import attention_flash
from engine.layers.attention import TorchAttentionBackend
from engine.layers.attention_flash import FlashAttentionBackend, import_flash
from tests.engine.kernels._util import make_batch


def _fa4_varlen(q, k, v, cu_seqlens_q=None, seqused_k=None, page_table=None, max_seqlen_q=None,
                max_seqlen_k=None, softmax_scale=None, causal=False, **unused):
    assert not unused, unused
    assert page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    assert cu_seqlens_q.shape[0] == page_table.shape[0] + 1
    num_pages, page, hkv, d = k.shape
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0])
    group = q.shape[1] // hkv
    for b in range(page_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        L = int(seqused_k[b])
        assert q1 - q0 <= max_seqlen_q and L <= max_seqlen_k
        pages = page_table[b, :(L + page - 1) // page].long()
        kb = k[pages].reshape(-1, hkv, d)[:L].repeat_interleave(group, 1).float()
        vb = v[pages].reshape(-1, hkv, d)[:L].repeat_interleave(group, 1).float()
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), kb) * softmax_scale
        if causal:  # query i of n sits at context position L - n + i
            n = q1 - q0
            pos_q = torch.arange(L - n, L)[:, None]
            s = s.masked_fill(torch.arange(L)[None, :] > pos_q, float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vb).to(q.dtype)
    return out, lse


@pytest.fixture
def fake_fa4(monkeypatch):
    pkg = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _fa4_varlen
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    # the Triton KV write needs a GPU here; the reference write stores the same values
    monkeypatch.setattr(attention_flash, "write_kv", write_kv_ref)


@pytest.mark.parametrize("seq_lens,q_lens", [
    ([23, 40, 1, 17], [23, 8, 1, 1]),     # fresh prompt, chunk over a cached prefix, decodes
    ([17, 33, 64, 5], [1, 1, 1, 1]),      # decode only
    ([16, 32], [16, 3]),                  # block boundaries
])
@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 1, 64, 16), (8, 2, 128, 32)])
def test_fa4_path_matches_torch(fake_fa4, seq_lens, q_lens, hq, hkv, d, bs):
    kv, meta = make_batch(seq_lens, q_lens, bs, hkv, d, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    backend = FlashAttentionBackend(hq, hkv, d)
    assert backend.impl == "fa4"
    kv_f, kv_r = kv.clone(), kv.clone()
    out = backend.forward(0, q, k, v, kv_f, meta)
    ref = TorchAttentionBackend(hq, hkv, d).forward(0, q, k, v, kv_r, meta)
    assert torch.equal(kv_f, kv_r)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fa4_graph_bounds_and_padding(fake_fa4):
    """Under a graph the host copies are None and the bounds are upper bounds; rows past the
    last query (padding) are not attended."""
    kv, meta = make_batch([9, 20], [3, 1], 16, 1, 64, torch.float32, "cpu")
    q, k, v = (torch.randn(5, h, 64) for h in (4, 1, 1))
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1])])
    meta.query_start_loc_cpu = meta.seq_lens_cpu = None
    meta.max_query_len, meta.max_seq_len = 16, 64
    out = FlashAttentionBackend(4, 1, 64).forward(0, q, k, v, kv.clone(), meta)
    ref = TorchAttentionBackend(4, 1, 64).forward(
        0, q[:4], k[:4], v[:4], kv.clone(), make_batch([9, 20], [3, 1], 16, 1, 64,
                                                        torch.float32, "cpu")[1])
    torch.testing.assert_close(out[:4], ref, atol=1e-5, rtol=1e-5)


def test_fp8_cache_refused(fake_fa4):
    kv, meta = make_batch([4], [4], 16, 1, 64, torch.float32, "cpu")
    q, k, v = (torch.randn(4, h, 64) for h in (4, 1, 1))
    with pytest.raises(ValueError, match="fp8"):
        FlashAttentionBackend(4, 1, 64).forward(0, q, k, v, kv.to(torch.float8_e4m3fn), meta)


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(RuntimeError, match="flash-attn-4.*triton"):
        import_flash()
