"""TritonAttentionBackend vs the torch reference backend on mixed / decode-only batches."""
import pytest
import torch

from engine.kernels.reference import paged_attention_torch, write_kv_ref
from engine.layers.attention import KVScales, TorchAttentionBackend
from engine.layers.attention_select import get_attention_backend
from engine.layers.attention_triton import TritonAttentionBackend

from ._util import make_batch


def _inputs(q_lens, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(T, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(T, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


@pytest.mark.parametrize("seq_lens,q_lens", [
    ([23, 40, 1, 17], [23, 8, 1, 1]),     # mixed: fresh prompt, chunk over prefix, decodes
    ([17, 33, 64, 5], [1, 1, 1, 1]),      # decode only (split kernel path)
])
@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 1, 64, 16), (8, 1, 128, 32), (2, 2, 64, 16)])
def test_triton_backend_matches_torch(seq_lens, q_lens, hq, hkv, d, bs, device):
    kv, meta = make_batch(seq_lens, q_lens, bs, hkv, d, torch.float32, device)
    q, k, v = _inputs(q_lens, hq, hkv, d, torch.float32, device)
    kv_t, kv_r = kv.clone(), kv.clone()
    out_t = TritonAttentionBackend(hq, hkv, d).forward(0, q, k, v, kv_t, meta)
    out_r = TorchAttentionBackend(hq, hkv, d).forward(0, q, k, v, kv_r, meta)
    assert torch.equal(kv_t, kv_r)  # same cache contents after the write
    torch.testing.assert_close(out_t, out_r, atol=3e-5, rtol=3e-5)


def test_triton_backend_fp8_and_padding(device):
    # fp8 cache with calibrated scales; the last token is graph padding (slot -1)
    seq_lens, q_lens = [30, 9], [14, 1]
    kv, meta = make_batch(seq_lens, q_lens, 16, 2, 64, torch.bfloat16, device,
                          kv_dtype=torch.float8_e4m3fn)
    q, k, v = _inputs(q_lens, 8, 2, 64, torch.bfloat16, device)
    meta.slot_mapping[3] = -1
    scales = KVScales(2, device)
    kv_t, kv_r = kv.clone(), kv.clone()
    out = TritonAttentionBackend(8, 2, 64).forward(1, q, k, v, kv_t, meta, scales)
    assert scales.calibrated[1] and not scales.calibrated[0]
    ks, vs = scales.k[1], scales.v[1]
    write_kv_ref(k, v, kv_r, meta.slot_mapping, ks, vs)
    assert (kv_t.view(torch.uint8) != kv_r.view(torch.uint8)).float().mean() < 0.01
    ref = paged_attention_torch(q, kv_r, meta, 0.125, ks, vs)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_triton_backend_no_host_sync(device, monkeypatch):
    """Graph-safety proxy: forward must not read device values on the host."""
    kv, meta = make_batch([9, 20], [1, 1], 16, 1, 64, torch.float32, device)
    q, k, v = _inputs([1, 1], 4, 1, 64, torch.float32, device)
    backend = TritonAttentionBackend(4, 1, 64)
    backend.forward(0, q, k, v, kv.clone(), meta)  # warm-up (compile) outside the guard

    def boom(*a, **kw):
        raise AssertionError("host sync in forward")

    meta.seq_lens_cpu = meta.query_start_loc_cpu = None
    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    backend.forward(0, q, k, v, kv.clone(), meta)
    meta.is_decode_only = False
    backend.forward(0, q, k, v, kv.clone(), meta)


def test_registry_and_bad_input(device):
    assert isinstance(get_attention_backend("triton", "cuda", 4, 1, 64), TritonAttentionBackend)
    kv, meta = make_batch([4], [4], 16, 1, 64, torch.float32, device)
    q, k, v = _inputs([4], 4, 1, 64, torch.float32, device)
    with pytest.raises(ValueError):
        TritonAttentionBackend(8, 1, 64).forward(0, q, k, v, kv, meta)
    with pytest.raises(ValueError, match="scales"):
        TritonAttentionBackend(4, 1, 64).forward(0, q, k, v, kv.to(torch.float8_e4m3fn), meta)


def test_flash_backend_clear_error_without_flash_attn():
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash_attn is installed")
    except ImportError:
        pass
    from engine.layers.attention_flash import FlashAttentionBackend

    with pytest.raises(RuntimeError, match="flash-attn"):
        FlashAttentionBackend(4, 1, 64)


@pytest.mark.parametrize("batch,max_seqs,expect_fused", [(4, None, True), (12, None, True), (12, 8, False)])
def test_forward_rope_fused_decode_matches_separate_and_torch(batch, max_seqs, expect_fused, device,
                                                              monkeypatch):
    """Decode-only forward_rope: rotary + KV append inside the decode kernel (every batch by
    default; none above fuse_decode_rope_max_seqs when that is set) == rope_write_kv + decode
    kernel == the torch backend (rotate, write, attend)."""
    from engine.kernels import decode_attention as da

    hq, hkv, d, bs = 8, 2, 64, 16
    lens = [5 + 7 * i for i in range(batch)]
    kv, meta = make_batch(lens, [1] * batch, bs, hkv, d, torch.float32, device)
    q, k, v = _inputs([1] * batch, hq, hkv, d, torch.float32, device, seed=batch)
    pos = torch.tensor([n - 1 for n in lens])
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv[None, :]
    rope = (f.cos().to(device), f.sin().to(device), torch.arange(batch, device=device))
    calls = []
    real = da.paged_decode_attention
    monkeypatch.setattr("engine.layers.attention_triton.paged_decode_attention",
                        lambda *a, **kw: calls.append("new_kv" in kw) or real(*a, **kw))
    outs, caches = [], []
    for fused in (True, False):
        be = TritonAttentionBackend(hq, hkv, d)
        be.fuse_decode_rope = fused
        if max_seqs is not None:
            be.fuse_decode_rope_max_seqs = max_seqs
        c = kv.clone()
        outs.append(be.forward_rope(0, q.clone(), k.clone(), v, rope, c, meta))
        caches.append(c)
    assert calls == [expect_fused, False]
    c = kv.clone()
    ref = TorchAttentionBackend(hq, hkv, d).forward_rope(0, q.clone(), k.clone(), v, rope, c, meta)
    for out, cache in zip(outs, caches):
        torch.testing.assert_close(cache, c, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
