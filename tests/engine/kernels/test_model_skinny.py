"""The model's fused decode path (skinny-GEMM kernels: norm+qkv, o_proj+residual,
norm+gate_up+silu, down+residual, lm_head) gives the unfused path's logits and tokens.
Runs the real kernels through the Triton interpreter on CPU (GPU with SPLITSERVE_KERNEL_TESTS_GPU=1)."""
import dataclasses

import pytest
import torch

from bench.engine_gpu_steps import decode_inputs
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.kernels.options import KernelOptions
from engine.sampling_params import SamplingParams


def _engine(shape, device):
    return Engine(EngineConfig(
        model=ModelConfig(model=f"dummy:{shape}", dtype="fp32", max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4),
        device=DeviceConfig(device=str(device), enforce_eager=True)))


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])  # qwen2: qkv bias, tied lm_head
def test_fused_decode_step_logits(shape, device):
    eng = _engine(shape, device)
    r = eng.runner
    ids, pos, meta = decode_inputs(eng, 3, 37)
    for t in r.kv_caches:
        t.normal_()
    kv0 = [t.clone() for t in r.kv_caches]
    out = {}
    with torch.inference_mode():
        for m in (0, 4):
            for t, t0 in zip(r.kv_caches, kv0):
                t.copy_(t0)
            r.model.skinny_max_m = m
            out[m] = r.model.compute_logits(r.model(ids, pos, r.kv_caches, meta, r.kv_scales))
    rel = ((out[4] - out[0]).norm() / out[0].norm()).item()
    assert rel < 1e-4, rel
    assert torch.equal(out[4].argmax(-1), out[0].argmax(-1))


def test_fused_path_greedy_tokens_equal(device):
    prompts = [[5, 9, 33, 2, 7], list(range(40, 61)), [300, 301]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine("tiny-llama", device).generate(prompts, params)
    eng = _engine("tiny-llama", device)
    eng.runner.model.skinny_max_m = 4  # decode steps (3 rows) take the fused path
    assert eng.generate(prompts, params) == want


def test_next_norm_fusion_gives_the_same_logits(device, monkeypatch):
    """KernelOptions.fuse_next_norm: where gate_up's norm runs as a kernel of its own,
    o_proj's last program computes it instead; one-row decode logits are the same (bit-identical
    in the interpreter; on a GPU the norm's sum of squares is reduced in another order)."""
    import engine.kernels.skinny_gemm as sg

    real = sg.default_config

    def norm_apart(m, n, k, dev, silu=False, table=None):  # the 8B table's one-row gate_up: norm apart
        cfg = real(m, n, k, dev, silu, table)
        return dataclasses.replace(cfg, norm_separate=True) if silu else cfg

    monkeypatch.setattr(sg, "default_config", norm_apart)
    eng = _engine("tiny-llama", device)
    r = eng.runner
    ids, pos, meta = decode_inputs(eng, 1, 37)
    for t in r.kv_caches:
        t.normal_()
    kv0 = [t.clone() for t in r.kv_caches]
    r.model.skinny_max_m = 4
    out, calls = {}, []
    monkeypatch.setattr(sg, "_nn_count", lambda dev, f=sg._nn_count: calls.append(1) or f(dev))
    with torch.inference_mode():
        for fuse in (False, True):
            r.model.set_kernels(KernelOptions(fuse_next_norm=fuse))
            for t, t0 in zip(r.kv_caches, kv0):
                t.copy_(t0)
            out[fuse] = r.model.compute_logits(r.model(ids, pos, r.kv_caches, meta, r.kv_scales))
    assert len(calls) == eng.arch.num_layers  # every layer's o_proj took it
    rel = ((out[True] - out[False]).norm() / out[False].norm()).item()
    assert rel < 1e-5, rel
    assert torch.equal(out[True].argmax(-1), out[False].argmax(-1))
