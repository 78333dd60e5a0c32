import pytest
import torch

from engine.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref
from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 96])
def test_rms_norm(dtype, n, device):
    torch.manual_seed(0)
    x = (torch.randn(5, 3, n) * 3).to(dtype).to(device)
    w = (1 + torch.randn(n) * 0.1).to(dtype).to(device)
    out = rms_norm(x, w, 1e-5)
    ref = rms_norm_ref(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype, device):
    torch.manual_seed(1)
    x = torch.randn(7, 128).to(dtype).to(device)
    r = torch.randn(7, 128).to(dtype).to(device)
    x0, r0 = x.clone(), r.clone()
    w = torch.randn(128).to(dtype).to(device)
    out, res = fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    # NOTE: the interpreter's fp32->bf16 cast truncates (GPU rounds to nearest): 1 ulp slack
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(res, ref_res, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


def test_rms_norm_bad_weight(device):
    with pytest.raises(ValueError):
        rms_norm(torch.zeros(2, 8, device=device), torch.zeros(4, device=device), 1e-6)
