"""The embedded default model (SmolLM2-135M-Instruct GGUF) through the whole engine equals HF
transformers' greedy generate token for token, one at a time and 4 concurrently; fp8 KV agrees."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.engine.hf_greedy import hf_greedy

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain photosynthesis to a child.", "List three prime numbers."]
NEW = 20


@pytest.fixture(scope="module")
def ids(smollm2_engine):
    tok = smollm2_engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                       add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def smollm2_engine():
    return Engine(EngineConfig(model=ModelConfig("default", dtype="fp32", max_model_len=2048),
                               cache=CacheConfig(num_blocks=256),
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _run(eng, prompts, params):
    return eng.generate(prompts, params, id_prefix=f"q{id(prompts)}-")


def test_smollm2_greedy_equals_hf(smollm2_engine, ids, hf_smollm2_model):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = hf_greedy(hf_smollm2_model, ids, NEW)
    # concurrently, with chunked prefill (budget 64 tokens) and the shared chat-template prefix
    assert _run(smollm2_engine, ids, params) == want
    # one at a time (prefix cache now warm)
    for p, w in zip(ids, want):
        assert _run(smollm2_engine, [p], params) == [w]
    assert smollm2_engine.kv.stats()["prefix_hits"] > 0
    text = smollm2_engine.tokenizer.decode(want[0])
    assert "Paris" in text, text
