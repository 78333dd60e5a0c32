"""The fused fp32 CPU ops (engine/layers/cpu_ops.py, engine/csrc/cpu_ops.c) against the torch
ops they replace: add + RMSNorm, SiLU-and-mul, rotary in place on strided q / k views; their
fallbacks (None / False) for other dtypes; and the modules using them when the runner set them."""
import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.cpu_ops import CpuOps, make
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import apply_rotary


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    o = make("auto")
    if o is None:
        pytest.skip("C kernels not built here (no compiler)")
    return o


@pytest.mark.parametrize("t", [1, 7, 300])  # one row, a few, past the one-thread size
def test_rms_norm_with_and_without_residual(ops, t):
    g = torch.Generator().manual_seed(t)
    x, r = torch.randn(t, 576, generator=g), torch.randn(t, 576, generator=g)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    ref = norm(x)
    ref2, ref_res = norm(x, r)
    torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, 1e-5), ref, rtol=1e-5, atol=1e-5)
    out, res = ops.rms_norm(x, r, norm.weight, 1e-5)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref2, rtol=1e-5, atol=1e-5)
    # the module takes the fused path once the runner sets cpu_ops (same results)
    norm.cpu_ops = ops
    torch.testing.assert_close(norm(x, r)[0], ref2, rtol=1e-5, atol=1e-5)


def test_rms_norm_strided_rows_and_fallbacks(ops):
    x = torch.randn(5, 2 * 64)[:, :64]  # rows of a wider buffer
    w = torch.randn(64)
    ref = RMSNorm(64, 1e-6)
    ref.weight.data = w
    torch.testing.assert_close(ops.rms_norm(x, None, w, 1e-6), ref(x), rtol=1e-5, atol=1e-5)
    assert ops.rms_norm(x.bfloat16(), None, w, 1e-6) is None
    assert ops.rms_norm(torch.randn(2, 3, 64), None, w, 1e-6) is None


@pytest.mark.parametrize("t", [1, 64])
def test_silu_mul(ops, t):
    x = torch.randn(t, 2 * 1536) * 6  # gates far into both tails of the sigmoid
    ref = SiluAndMul()(x)
    torch.testing.assert_close(ops.silu_mul(x), ref, rtol=1e-5, atol=1e-5)
    assert ops.silu_mul(x.bfloat16()) is None


@pytest.mark.parametrize("t", [1, 40])
def test_rotary_in_place_on_qkv_views(ops, t):
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
    ang = torch.rand(t, d // 2) * 50
    cos, sin = ang.cos(), ang.sin()
    ref_q, ref_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    v_before = v.clone()
    assert ops.rotary(q, k, cos, sin)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)  # only q and k rows were touched
    assert not ops.rotary(q.bfloat16(), k.bfloat16(), cos, sin)


def test_skinny_gemm_matches_f_linear():
    from engine.layers import cpu_skinny

    sk = cpu_skinny.make("auto")
    if sk is None:
        pytest.skip("C kernels not built here (no compiler)")
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 3, 5, 8, 12, 13, 25, 64):
        for n, k in ((50, 33), (48, 576), (1000, 7)):  # tiles with a ragged last one, odd K
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            x = torch.randn(m + 2, k, generator=g)[1:m + 1]  # rows inside a larger buffer
            ref = torch.nn.functional.linear(x, w, b)
            torch.testing.assert_close(sk(x, cpu_skinny.pack(w), n, b), ref, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(sk(x, cpu_skinny.pack(w.t().contiguous().t()), n),
                                       ref - b, rtol=1e-5, atol=1e-4)  # any weight strides
    assert sk(torch.randn(65, 7), cpu_skinny.pack(torch.randn(5, 7)), 5) is None  # 65 rows: not its job


def test_engine_serves_decode_rows_through_the_skinny_kernel_with_greedy_output_unchanged(monkeypatch):
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
    from engine.engine import Engine
    from engine.layers.linear import Linear
    from engine.sampling_params import SamplingParams

    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def run(mode):
        eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                                  cache=CacheConfig(num_blocks=32),
                                  device=DeviceConfig(device="cpu", cpu_kernels=mode)))
        return eng, eng.generate([[5, 6, 7, 8, 9], [3, 4]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                           ignore_eos=True))

    eng, out = run("auto")
    if eng.runner.cpu_skinny is None:
        pytest.skip("C kernels not built here (no compiler)")
    lins = [m for m in eng.runner.model.modules() if isinstance(m, Linear)]
    assert lins and all(m.skinny is not None for m in lins) and eng.runner.skinny_head is not None
    _, ref = run("torch")
    assert out == ref
