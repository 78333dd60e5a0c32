"""The CPU serving path as `splitserve up` runs it: [in, out] weight layout (engine/cpu_layout.py)
and the batched CPU attention. Greedy output still equals HF transformers' token for token.

NOTE: the kernel tests set TRITON_INTERPRET for the whole session, under which the runner
keeps the [out, in] layout (the interpreted Triton matmuls need it); here it is unset while the
engines are built."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.layers.linear import Linear
from engine.sampling_params import SamplingParams
from tests.engine.hf_greedy import hf_greedy

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain photosynthesis to a child.", "List three prime numbers."]
NEW = 20


def _engine(model="default", layout=True, **sched):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return Engine(EngineConfig(model=ModelConfig(model, dtype="fp32", max_model_len=2048),
                                   cache=CacheConfig(num_blocks=256),
                                   scheduler=SchedulerConfig(**sched),
                                   device=DeviceConfig(device="cpu", cpu_weight_layout=layout)))


@pytest.fixture(scope="module")
def smollm2_cpu():
    return _engine(max_num_batched_tokens=64)


def _in_out(w: torch.Tensor) -> bool:
    return w.t().is_contiguous() and not w.is_contiguous()


def test_layout_applies_to_every_matmul_and_keeps_the_embedding(smollm2_cpu, tiny_hf_dirs):
    m = smollm2_cpu.runner.model
    lins = [x for x in m.modules() if isinstance(x, Linear)]
    assert lins and all(_in_out(x.weight) for x in lins)
    assert _in_out(m.lm_head_weight) and m.embed_tokens.is_contiguous()  # tied: its own copy
    torch.testing.assert_close(m.lm_head_weight, m.embed_tokens, rtol=0, atol=0)
    off = _engine(tiny_hf_dirs["llama"][1], layout=False)
    assert all(x.weight.is_contiguous() for x in off.runner.model.modules() if isinstance(x, Linear))


def test_smollm2_greedy_equals_hf_on_the_cpu_path(smollm2_cpu, hf_smollm2_model):
    eng = smollm2_cpu
    tok = eng.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                      add_special_tokens=False) for p in PROMPTS]
    want = hf_greedy(hf_smollm2_model, ids, NEW)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    # concurrently (chunked prefill: prompt chunks after cached tokens mix with decode rows)
    assert eng.generate(ids, params, id_prefix="c-") == want
    for i, (p, w) in enumerate(zip(ids, want)):  # one at a time, the prefix cache warm
        assert eng.generate([p], params, id_prefix=f"s{i}-") == [w]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied / tied LM head, qkv bias
def test_tiny_greedy_equals_hf_with_layout(tiny_hf_dirs, kind):
    model, path = tiny_hf_dirs[kind]
    prompts = [[5, 9, 33, 7, 100, 3] * 3, [40, 41], list(range(3, 60))]
    want = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(g[0, len(p):].tolist())
    eng = _engine(path)
    got = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert got == want
