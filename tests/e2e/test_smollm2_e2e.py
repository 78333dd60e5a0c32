"""Where text matters: the embedded SmolLM2-135M-Instruct through the three real processes.
Greedy text through gRPC (raw prompt), REST chat (openai client, stream and not) equals the
engine's own greedy output; a stop string cuts the text exactly where it first appears; a second
prompt sharing a long prefix moves only the KV blocks decode does not hold yet."""
from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from protos import generate_pb2, generate_pb2_grpc
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
ARGS = ["--model", "default", "--dtype", "fp32", "--device", "cpu", "--max-model-len", "512",
        "--num-blocks", "64", "--enforce-eager"]
MODEL = "SmolLM2-135M-Instruct"
N = 12


@pytest.fixture(scope="module")
def services():
    s = harness.start_stack(ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=ModelConfig("default", dtype="fp32", max_model_len=512),
                               cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)))


def engine_text(eng, ids, max_tokens=N) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    eng.add_request(f"r{len(ids)}-{ids[-1]}", ids, params)
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
    return eng.tokenizer.decode(out)


async def test_grpc_prompt_text_equals_engine(services, engine):
    prompt = "The capital of France is"
    want = engine_text(engine, engine.tokenizer.encode(prompt, add_special_tokens=True))
    async with grpc.aio.insecure_channel(services.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        resps = [r async for r in stub.Generate(generate_pb2.GenerateRequest(
            prompt=prompt, max_tokens=N, sampling=generate_pb2.SamplingParams(temperature=0.0)))]
        got = "".join(r.text for r in resps)
        assert got == want, services.logs()
        assert len(resps) > 1
        # a stop string taken from the middle of the output cuts the text right before it
        words = want.split()
        if len(words) >= 3:
            stop = words[2]
            resps = [r async for r in stub.Generate(generate_pb2.GenerateRequest(
                prompt=prompt, max_tokens=N, stop=[stop],
                sampling=generate_pb2.SamplingParams(temperature=0.0)))]
            assert "".join(r.text for r in resps) == want[:want.index(stop)]
            assert resps[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
            assert resps[-1].stop_reason == stop


def test_openai_chat_text_equals_engine(services, engine):
    msgs = [{"role": "user", "content": "Say hello in French."}]
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    want = engine_text(engine, ids)
    c = openai.OpenAI(base_url=services.http_url + "/v1", api_key="none", timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=N, temperature=0, stream=True) if ch.choices)
    assert streamed == want


def _decode_reused_blocks(services) -> float:
    url = f"http://127.0.0.1:{services.decodes[0].metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "splitserve_kv_prefix_reused_blocks_total")


async def test_shared_prefix_is_not_sent_twice(services, engine):
    """Two prompts sharing a long prefix through the gateway: decode holds the first's full
    blocks, so the second's transfer skips them; greedy text still equals the engine's."""
    system = "A geography teacher wrote these facts about Europe for a class of twelve-year-olds. " * 3
    prompts = [system + "The capital of France is", system + "The capital of Italy is"]
    ids = [engine.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    held = common // engine.cfg.cache.block_size
    assert held >= 3, f"the prompts share only {common} tokens"
    want = [engine.tokenizer.decode(t) for t in engine.generate(ids, SamplingParams(max_tokens=6, temperature=0.0))]
    async with grpc.aio.insecure_channel(services.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        reused = [_decode_reused_blocks(services)]
        for p, text in zip(prompts, want):
            resps = [r async for r in stub.Generate(generate_pb2.GenerateRequest(
                prompt=p, max_tokens=6, sampling=generate_pb2.SamplingParams(temperature=0.0)))]
            assert "".join(r.text for r in resps) == text, services.logs()
            reused.append(_decode_reused_blocks(services))
    assert reused[1] - reused[0] == 0  # nothing of the first prompt was held
    assert reused[2] - reused[1] == held, (reused, held, services.logs()[-3000:])
