"""Fused rotary + KV write == the two kernels it replaces (and their torch references)."""
import pytest
import torch

from engine.kernels.kv_write import write_kv
from engine.kernels.reference import rotary_neox_ref, write_kv_ref
from engine.kernels.rope_kv_write import rope_write_kv
from engine.kernels.rotary import rotary_neox_


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (6, 1, 16), (8, 8, 32)])
def test_matches_rotary_then_write(dtype, hq, hk, d, device):
    g = torch.Generator().manual_seed(hq * 10 + d)
    T, bs, nb = 11, 16, 4
    act = torch.float32 if dtype in (torch.float32, torch.float8_e4m3fn) else dtype
    qkv = torch.randn(T, hq + 2 * hk, d, generator=g).to(act).to(device)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    pos = torch.randint(0, 500, (T,), generator=g)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = f.cos().to(device), f.sin().to(device)
    idx = torch.arange(T, device=device)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(device)
    slots[[2, 7]] = -1
    init = torch.randn(2, nb, bs, hk, d, generator=g).to(dtype).to(device)
    ks = vs = None
    if dtype == torch.float8_e4m3fn:
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.3, device=device)
    # reference: rotate (fp32 math, cast), then write
    q_ref, k_ref = rotary_neox_ref(idx, q, k, cos, sin)
    cache_ref = init.clone()
    write_kv_ref(k_ref, v, cache_ref, slots, ks, vs)
    # the two unfused kernels: same math and rounding points -> bit-exact
    q2, k2, cache2 = q.clone(), k.clone(), init.clone()
    rotary_neox_(idx, q2, k2, cos, sin)
    write_kv(k2, v, cache2, slots, ks, vs)
    cache = init.clone()
    k0 = k.clone()
    rope_write_kv(idx, q, k, v, cos, sin, cache, slots, ks, vs)
    assert torch.equal(q, q2)
    assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8))
    tol = dict(rtol=1e-5, atol=1e-5) if act == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)
    assert torch.equal(k, k0), "k must be left as it was"
    if dtype == torch.float8_e4m3fn:
        torch.testing.assert_close(cache.float(), cache_ref.float(), rtol=0.13, atol=0.0)
        assert (cache.view(torch.uint8) != cache_ref.view(torch.uint8)).float().mean() < 0.01
    else:
        torch.testing.assert_close(cache.float(), cache_ref.float(), **tol)
        # padding slots: nothing else changed
        flat = cache.view(2, -1, hk, d).cpu()
        mask = torch.ones(flat.shape[1], dtype=torch.bool)
        mask[slots[slots >= 0].cpu()] = False
        assert torch.equal(flat[:, mask], init.view(2, -1, hk, d).cpu()[:, mask])


def test_bad_inputs(device):
    q = torch.zeros(3, 4, 16, device=device)
    k = torch.zeros(3, 2, 16, device=device)
    kv = torch.zeros(2, 2, 16, 2, 16, device=device)
    idx = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="whole head_dim"):
        rope_write_kv(idx, q, k, k, torch.zeros(3, 4, device=device), torch.zeros(3, 4, device=device),
                      kv, idx)
    with pytest.raises(ValueError, match="scale"):
        rope_write_kv(idx, q, k, k, torch.zeros(3, 8, device=device), torch.zeros(3, 8, device=device),
                      kv.to(torch.float8_e4m3fn), idx)
