"""TritonAttentionBackend vs the torch reference backend on mixed / decode-only batches."""
import pytest
import torch

from engine.kernels.reference import paged_attention_torch, write_kv_ref
from engine.layers.attention import KVScales, TorchAttentionBackend, get_attention_backend
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
