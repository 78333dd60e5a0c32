"""Greedy decoding through the whole engine (scheduler + paged KV + runner + sampler) equals
HF transformers' generate token for token, on tiny random Llama / Qwen2 checkpoints."""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 12


def _tiny_hf(kind: str, path):
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=False, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    # Larger weights than the default init so greedy paths are not all one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return _tiny_hf(request.param, path), str(path)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(37)]  # shared prefix -> prefix-cache hits
    out = []
    for i in range(n):
        ln = rng.randrange(1, 70)
        tail = [rng.randrange(3, 384) for _ in range(ln)]
        out.append(shared + tail if i % 2 == 0 else tail)
    return out


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return g[0, len(prompt):].tolist()


def _engine_greedy(path, prompts, block_size=16, prefix=True, budget=2048):
    cfg = EngineConfig(model=ModelConfig(model=path, dtype="fp32"),
                       cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix,
                                         num_blocks=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    eng = Engine(cfg)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = eng.generate(prompts, params)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks or prefix  # cached blocks may stay
    return got, eng


@pytest.mark.parametrize("n,block_size,prefix,budget", [
    (1, 16, True, 2048),
    (8, 16, True, 2048),
    (8, 32, False, 2048),
    (8, 16, True, 24),   # chunked prefill forced: prompts split across steps
    (8, 32, True, 40),
])
def test_engine_greedy_equals_hf(tiny, n, block_size, prefix, budget):
    model, path = tiny
    prompts = _prompts(n)
    want = [_hf_greedy(model, p) for p in prompts]
    got, eng = _engine_greedy(path, prompts, block_size, prefix, budget)
    assert got == want
    if prefix and n > 1:
        assert eng.kv.stats()["prefix_hits"] > 0, "shared prefix should hit the prefix cache"
