"""The REST bridge does what OpenAI clients expect: no max_tokens = until the end token or the
context, an unknown model is OpenAI's 404 model_not_found, fields that cannot be honoured are
a 400 naming them (never silently ignored), and vLLM's /tokenize and /detokenize."""
from __future__ import annotations

import httpx
import openai
import pytest

from gateway.grpc_server import request_from_pb
from gateway.validate import Limits
from tests.gateway.conftest import asgi_client
from tests.harness import TINY_CPU, start_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def stack(rest_stack):
    return rest_stack


_client = asgi_client


# ---- max_tokens unset ---------------------------------------------------------------------

async def test_no_max_tokens_runs_to_the_end_of_the_context(stack):
    async with _client(stack) as c:
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "abc"})
        j = r.json()
        assert r.status_code == 200, j
        # the fake decode never sends an end token: the context (256) ends the request
        assert j["choices"][0]["finish_reason"] == "length"
        assert j["usage"]["prompt_tokens"] + j["usage"]["completion_tokens"] == 256
        r = await c.post("/v1/chat/completions", json=CHAT)
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 256


async def test_default_max_tokens_flag_still_applies(stack):
    async with _client(stack, default_max_tokens=5) as c:
        j = (await c.post("/v1/completions", json={"model": "fake-model", "prompt": "abc"})).json()
        assert j["usage"]["completion_tokens"] == 5
        j = (await c.post("/v1/completions", json={"model": "fake-model", "prompt": "abc",
                                                    "max_tokens": 2})).json()
        assert j["usage"]["completion_tokens"] == 2


async def test_grpc_generate_without_max_tokens_runs_to_the_end_of_the_context():
    from protos import generate_pb2
    from tests.gateway.conftest import make_core

    core = make_core([], [])
    pb = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    assert (await request_from_pb(core, pb, Limits(256, 512))).params.max_tokens == 256 - 3
    assert (await request_from_pb(core, pb, Limits(256, 512, 7))).params.max_tokens == 7
    pb.max_tokens = 4
    assert (await request_from_pb(core, pb, Limits(256, 512, 7))).params.max_tokens == 4


# ---- model -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}),
    ("/tokenize", {"model": "gpt-4o", "prompt": "x"}),
    ("/detokenize", {"model": "gpt-4o", "tokens": [97]}),
])
async def test_unknown_model_is_404_model_not_found(stack, path, body):
    async with _client(stack) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["param"] == "model"
    assert "The model `gpt-4o` does not exist" in err["message"] and "fake-model" in err["message"]


async def test_official_client_sees_not_found(stack):
    async with _client(stack) as http:
        c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
        with pytest.raises(openai.NotFoundError) as e:
            await c.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
        assert e.value.code == "model_not_found"
        r = await c.chat.completions.create(model="fake-model", messages=CHAT["messages"],
                                            max_tokens=3)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


# ---- fields that cannot be honoured -------------------------------------------------------------

@pytest.mark.parametrize("extra,param,needle", [
    ({"n": 2}, "n", "'n' must be 1"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema", "'response_format.json_schema.schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type",
     "'response_format.type' must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": "json"}, "response_format", "'response_format' must be an object"),
    ({"logit_bias": {"50": 100}}, "logit_bias", "'logit_bias' is not supported"),
    ({"guided_json": {"type": "object"}}, "guided_json", "'guided_json' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "'tools' is not supported"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_unhonoured_fields_are_400_naming_them(stack, extra, param, needle, stream):
    async with _client(stack) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, **extra, "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize("extra", [{"response_format": {"type": "text"}}, {"logit_bias": {}},
                                   {"n": 1}, {"response_format": None}])
async def test_neutral_values_are_accepted(stack, extra):
    async with _client(stack) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, **extra, "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- /tokenize, /detokenize ------------------------------------------------------------------

async def test_tokenize_and_detokenize(stack):
    tok = stack.core.tokenizer
    async with _client(stack) as c:
        j = (await c.post("/tokenize", json={"prompt": "hello"})).json()
        assert j == {"count": 5, "max_model_len": 256, "tokens": tok.encode("hello"),
                     "token_strs": None}
        j = (await c.post("/tokenize", json={"model": "fake-model", "prompt": "hi",
                                             "return_token_strs": True})).json()
        assert j["token_strs"] == ["h", "i"]
        j = (await c.post("/tokenize", json={"messages": CHAT["messages"]})).json()
        text = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True)
        assert j["tokens"] == tok.encode(text, add_special_tokens=False)
        j2 = (await c.post("/tokenize", json={"messages": CHAT["messages"],
                                              "add_generation_prompt": False})).json()
        assert j2["count"] < j["count"]
        r = await c.post("/detokenize", json={"tokens": j["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": tok.decode(j["tokens"], False)}
        assert (await c.post("/detokenize", json={"tokens": [104, 105]})).json() == {"prompt": "hi"}


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {}, "one of 'prompt' or 'messages' is required"),
    ("/tokenize", {"prompt": 5}, "'prompt' must be a string"),
    ("/tokenize", {"messages": []}, "'messages' must be a non-empty array"),
    ("/detokenize", {}, "'tokens' is required"),
    ("/detokenize", {"tokens": ["a"]}, "'tokens[0]' must be an integer"),
    ("/detokenize", {"tokens": [10 ** 6]}, "out of range"),
])
async def test_tokenize_bad_bodies_are_400(stack, path, body, needle):
    async with _client(stack) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


# ---- the same over real sockets ------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_real_gateway_openai_client_fidelity():
    stack = start_stack(TINY_CPU)
    try:
        c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none")
        model = c.models.list().data[0].id
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="nope", prompt="x", max_tokens=2)
        assert e.value.code == "model_not_found"
        # no max_tokens: an end token or the context (256) ends it, not a default of 16
        r = c.completions.create(model=model, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
        # a schema the grammar library cannot compile: prefill refuses it, the client sees 400
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=CHAT["messages"], response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}})
        assert "response_format.json_schema: schema not supported" in str(e.value)
        t = httpx.post(stack.http_url + "/tokenize", json={"model": model, "prompt": "hello"}).json()
        assert t["count"] == len(t["tokens"]) > 0
        d = httpx.post(stack.http_url + "/detokenize", json={"model": model, "tokens": t["tokens"]}).json()
        assert d["prompt"] == "hello"
    finally:
        stack.stop()
