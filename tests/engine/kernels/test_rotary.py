import pytest
import torch

from engine.kernels.reference import rope_cos_sin_ref, rotary_neox_ref
from engine.kernels.rotary import rotary_neox_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,rot", [(4, 1, 64, 64), (8, 8, 128, 128), (3, 1, 64, 32)])
def test_rotary_in_place_matches_reference(dtype, hq, hk, d, rot, device):
    torch.manual_seed(0)
    T = 11
    cos, sin = rope_cos_sin_ref(300, rot, theta=500000.0, device=device)
    pos = torch.randint(0, 300, (T,), device=device)
    # q and k as strided views of a fused qkv activation
    qkv = torch.randn(T, hq + 2 * hk, d).to(dtype).to(device)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    v_before = qkv[:, hq + hk:].clone()
    ref_q, ref_k = rotary_neox_ref(pos, q, k, cos, sin)
    rotary_neox_(pos, q, k, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, hq + hk:], v_before)  # v untouched


def test_rotary_position_zero_is_identity(device):
    cos, sin = rope_cos_sin_ref(8, 64, device=device)
    q = torch.randn(2, 2, 64, device=device)
    k = torch.randn(2, 1, 64, device=device)
    q0, k0 = q.clone(), k.clone()
    rotary_neox_(torch.zeros(2, dtype=torch.long, device=device), q, k, cos, sin)
    torch.testing.assert_close(q, q0)
    torch.testing.assert_close(k, k0)


def test_rotary_bad_shapes(device):
    cos, sin = rope_cos_sin_ref(8, 128, device=device)
    with pytest.raises(ValueError):
        rotary_neox_(torch.zeros(2, dtype=torch.long), torch.zeros(2, 2, 64), torch.zeros(2, 1, 64), cos, sin)
