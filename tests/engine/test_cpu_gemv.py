"""One-row CPU matmuls chosen by measurement (engine/cpu_gemv.py): each shape gets the faster of
F.linear and oneDNN's packed copy, the chosen function gives F.linear's product to fp32
rounding, nothing is chosen without a packed copy, and the engine wires it (layers and head)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_gemv, cpu_matmul
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.layers.linear import Linear
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="torch built without oneDNN")


def _lin(i, o, bias=False, packed=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = Linear(i, o, bias=bias, dtype=torch.float32)
    lin.weight.data.normal_(generator=g)
    if bias:
        lin.bias.data.normal_(generator=g)
    if packed:
        lin.packed = cpu_matmul.pack(lin.weight)
    lin.weight.data = lin.weight.data.t().contiguous().t()  # the CPU layout
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_each_shape_gets_one_choice_and_its_product(bias):
    mods = [_lin(64, 96, bias, seed=s) for s in range(3)] + [_lin(96, 64, bias, seed=9)]
    table = cpu_gemv.choose(mods, min_bytes=1 << 16)
    assert set(table) == {(96, 64), (64, 96)}
    for shape, t in table.items():
        assert t["best"] in ("torch", "packed") and t["torch"] > 0 and t["packed"] > 0
        ms = [m for m in mods if tuple(m.weight.shape) == shape]
        assert all((m.packed_min_rows == 1) == (t["best"] == "packed") for m in ms)
    for m in mods:
        x = torch.randn(1, m.in_features)
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-4)
        xs = torch.randn(4, m.in_features)  # 2+ rows: the packed path, as before
        torch.testing.assert_close(m(xs), F.linear(xs, m.weight, m.bias), rtol=1e-5, atol=1e-4)


def test_forced_choice_routes_one_row_calls(monkeypatch):
    import engine.layers.linear as linear_mod

    lin = _lin(32, 48)
    monkeypatch.setattr(cpu_gemv, "_time", lambda fns, x: {"torch": 2.0, "packed": 1.0})
    cpu_gemv.choose([lin])
    rows = []
    real = linear_mod.packed_linear
    monkeypatch.setattr(linear_mod, "packed_linear", lambda x, p, b: rows.append(x.shape[0]) or real(x, p, b))
    lin(torch.randn(1, 32))
    lin(torch.randn(3, 32))
    assert rows == [1, 3]  # one row now packed too; 2+ rows packed as before
    monkeypatch.setattr(cpu_gemv, "_time", lambda fns, x: {"torch": 1.0, "packed": 2.0})
    cpu_gemv.choose([lin])
    rows.clear()
    lin(torch.randn(1, 32))
    assert lin.packed_min_rows == 2 and rows == []  # one row back on F.linear


def test_no_packed_copy_no_choice():
    lin = _lin(32, 48, packed=False)
    assert cpu_gemv.choose([lin]) == {} and lin.packed_min_rows == 2


@pytest.mark.parametrize("one_row", ["auto", "torch"])
def test_engine_sets_it_up_and_keeps_greedy_output(one_row, monkeypatch):
    # the choice applies where the C kernels do not serve one-row matmuls (cpu_kernels=torch)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # force the packed choice so "auto" exercises it whatever this machine measures
    monkeypatch.setattr(cpu_gemv, "_time", lambda fns, x: {"torch": 2.0, "packed": 1.0})

    def run(mode):
        eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                                  cache=CacheConfig(num_blocks=32),
                                  device=DeviceConfig(device="cpu", cpu_one_row_matmul=mode,
                                                      cpu_kernels="torch")))
        return eng, eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                   ignore_eos=True))

    eng, out = run(one_row)
    lins = [m for m in eng.runner.model.modules() if isinstance(m, Linear)]
    assert all((m.packed_min_rows == 1) == (one_row == "auto") for m in lins)
    assert (eng.runner.head_packed_min_rows == 1) == (one_row == "auto")
    _, ref = run("torch")
    assert out == ref
