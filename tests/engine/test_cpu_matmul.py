"""CPU fp32 matmuls of 2+ rows through oneDNN-prepacked weights (engine/cpu_matmul.py): the same
products as F.linear to fp32 rounding, one-row inputs unchanged, on by default for small fp32
models and off where it does not apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_matmul
from engine.config import CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.layers.linear import Linear, row_bucket

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [2, 7, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 160, bias=bias, dtype=torch.float32)
    lin.weight.data.normal_(generator=g)
    if bias:
        lin.bias.data.normal_(generator=g)
    x = torch.randn(rows, 96, generator=g)
    want = F.linear(x, lin.weight, lin.bias)
    lin.weight.data = lin.weight.data.t().contiguous().t()  # the CPU layout: any strides pack
    lin.packed = cpu_matmul.pack(lin.weight)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-4)
    one = x[:1]
    assert torch.equal(lin(one), F.linear(one, lin.weight, lin.bias))  # one row: plain F.linear


def test_row_buckets_bound_the_shapes():
    assert [row_bucket(n) for n in (2, 3, 5, 9, 39, 64, 127, 128, 129, 2048)] == \
        [2, 4, 8, 16, 40, 64, 128, 128, 144, 2048]
    assert len({row_bucket(n) for n in range(2, 2049)}) == 3 + 15 + 120


def test_logits_through_the_packed_head():
    w = torch.randn(300, 64)
    h = torch.randn(5, 64)
    torch.testing.assert_close(cpu_matmul.logits(h, w, cpu_matmul.pack(w)), h @ w.t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu_matmul.logits(h[:1], w, cpu_matmul.pack(w)), F.linear(h[:1], w))


def _engine(dtype="fp32", packed="auto"):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # the kernel tests' interpreter keeps the GPU layout
        return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype=dtype, max_model_len=128),
                                   cache=CacheConfig(num_blocks=32),
                                   device=DeviceConfig(device="cpu", cpu_packed_matmul=packed)))


@pytest.mark.parametrize("dtype, packed, want", [("fp32", "auto", True), ("fp32", "off", False),
                                                 ("bf16", "auto", False)])
def test_runner_packs_small_fp32_models_by_default(dtype, packed, want):
    eng = _engine(dtype, packed)
    lins = [m for m in eng.runner.model.modules() if isinstance(m, Linear)]
    assert all((m.packed is not None) == want for m in lins)
    assert (eng.runner.packed_head is not None) == want


def test_config_names_a_bad_choice():
    with pytest.raises(ConfigError, match="cpu_packed_matmul"):
        DeviceConfig(cpu_packed_matmul="maybe")
