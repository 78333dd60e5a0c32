"""The slab GEMV prototype of bench/kernel_boundary.py against torch (interpreter on CPU):
its timings only mean something if it computes the product."""
import pytest
import torch

from bench.kernel_boundary import slab_gemv


@pytest.mark.parametrize("n,k,rps,programs", [(37, 64, 2, 4), (40, 100, 4, 3), (9, 32, 1, 16), (64, 128, 2, 8)])
def test_slab_gemv_matches_torch(n, k, rps, programs, device):
    g = torch.Generator().manual_seed(n * k + rps)
    x = torch.randn(1, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    out = torch.full((1, n), float("nan"), device=device)
    slab_gemv(x, w, out, rps, programs, num_warps=4)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-4)  # every row written once
