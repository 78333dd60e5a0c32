import pytest
import torch

from engine.kernels.kv_write import write_kv
from engine.kernels.reference import write_kv_ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_matches_reference(dtype, block_size, device):
    torch.manual_seed(0)
    T, H, D, nb = 37, 2, 64, 5
    act = torch.float32 if dtype in (torch.float32, torch.float8_e4m3fn) else dtype
    # k, v as strided views of one fused qkv tensor, like the model produces
    qkv = torch.randn(T, 3 * H, D, dtype=act, device=device)
    k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]
    slots = torch.randperm(nb * block_size)[:T].to(device)
    slots[[3, 10, 36]] = -1  # padding tokens: must not be written
    init = torch.randn(2, nb, block_size, H, D).to(dtype).to(device)
    a, b = init.clone(), init.clone()
    ks = vs = None
    if dtype == torch.float8_e4m3fn:
        ks = torch.tensor(0.01, device=device)  # small scale: some values clamp at 448
        vs = torch.tensor(0.5, device=device)
    write_kv(k, v, a, slots, ks, vs)
    write_kv_ref(k, v, b, slots, ks, vs)
    if dtype == torch.float8_e4m3fn:
        # conversion rounding may differ by one fp8 step on a tie
        torch.testing.assert_close(a.float(), b.float(), rtol=0.13, atol=0.0)
        assert (a.view(torch.uint8) != b.view(torch.uint8)).float().mean() < 0.01
    else:
        assert torch.equal(a, b)
    # untouched slots keep their old contents
    written = torch.zeros(nb * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    flat_a = a.view(2, nb * block_size, H, D).cpu()
    flat_i = init.view(2, nb * block_size, H, D).cpu()
    assert torch.equal(flat_a[:, ~written].view(torch.uint8) if dtype == torch.float8_e4m3fn else flat_a[:, ~written],
                       flat_i[:, ~written].view(torch.uint8) if dtype == torch.float8_e4m3fn else flat_i[:, ~written])


def test_bad_shapes_raise(device):
    kv = torch.zeros(2, 2, 16, 2, 64, device=device)
    k = torch.zeros(3, 2, 32, device=device)
    with pytest.raises(ValueError):
        write_kv(k, k, kv, torch.zeros(3, dtype=torch.long, device=device))
    kv8 = kv.to(torch.float8_e4m3fn)
    k = torch.zeros(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="scale"):
        write_kv(k, k, kv8, torch.zeros(3, dtype=torch.long, device=device))
