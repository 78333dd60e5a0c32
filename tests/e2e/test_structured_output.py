"""response_format through a real stack (`splitserve up --topology split`, SmolLM2 on CPU: prefill
samples the first token under the mask, decode the rest): json_schema gives JSON valid against
the schema for 20 concurrent chat prompts, json_object a JSON object on /v1/completions, the gRPC
API's GuidedDecoding the same, and a schema the grammar library cannot compile is a 400 naming
response_format.json_schema."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import openai
import pytest

from protos import generate_pb2, generate_pb2_grpc
from tests.harness import UP_PORTS, splitserve_up

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
MODEL = "SmolLM2-135M-Instruct"
# split: prefill samples the first token under the mask, decode rebuilds the grammar and goes on
ARGS = [*UP_PORTS, "--topology", "split", "--model", "default", "--dtype", "fp32", "--device", "cpu",
        "--max-model-len", "512", "--num-blocks", "160", "--enforce-eager"]
# small on purpose: ~12 tokens an answer keeps 20 concurrent requests short on 2 CPU cores
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12}, "capital": {"type": "boolean"}},
          "required": ["city", "capital"], "additionalProperties": False}
TOPICS = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul", "Accra",
          "Lyon", "Osaka", "Porto", "Perth", "Bern", "Kyiv", "Hanoi", "Dakar", "Riga", "Sofia"]


@pytest.fixture(scope="module")
def up():
    with splitserve_up(ARGS) as u:
        yield u


async def test_json_schema_20_concurrent_prompts(up):
    c = openai.AsyncOpenAI(base_url=up.rest + "/v1", api_key="none", max_retries=0, timeout=240)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}

    async def one(i: int, topic: str):
        return await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format=fmt, max_tokens=32, temperature=0.0 if i % 2 else 0.8, seed=i)

    t0 = time.perf_counter()
    rs = await asyncio.gather(*(one(i, t) for i, t in enumerate(TOPICS)))
    dt = time.perf_counter() - t0
    for r in rs:
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (text, up.log()[-3000:])
        jsonschema.validate(json.loads(text), SCHEMA)
    print(f"20 json_schema requests in {dt:.1f} s")


async def test_json_schema_streamed(up):
    c = openai.AsyncOpenAI(base_url=up.rest + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Madrid as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        max_tokens=32, temperature=0.0, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_json_object_on_completions(up):
    c = openai.AsyncOpenAI(base_url=up.rest + "/v1", api_key="none", max_retries=0, timeout=120)
    # the client's completions call has no response_format argument: it rides in the body
    r = await c.completions.create(model=MODEL, prompt="A JSON object with a name and an age:",
                                   max_tokens=64, temperature=0.0,
                                   extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


async def test_grpc_guided_decoding(up):
    async with grpc.aio.insecure_channel(up.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        sp = generate_pb2.SamplingParams(
            temperature=0.0, guided=generate_pb2.GuidedDecoding(json_schema=json.dumps(SCHEMA)))
        resps = [r async for r in stub.Generate(generate_pb2.GenerateRequest(
            messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
                role="user", content="Describe Berlin as JSON.")]), max_tokens=32, sampling=sp))]
        assert resps[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads("".join(r.text for r in resps)), SCHEMA)


async def test_unsupported_schema_is_400_naming_the_field(up):
    c = openai.AsyncOpenAI(base_url=up.rest + "/v1", api_key="none", max_retries=0, timeout=60)
    bad = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        response_format=bad, max_tokens=8)
    assert "response_format.json_schema: schema not supported" in str(e.value)
