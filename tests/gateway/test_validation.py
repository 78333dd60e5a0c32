"""Hostile requests on both fronts (issue 25): each was a 500, an UNKNOWN, a hang or silently
accepted; each is now a 4xx / INVALID_ARGUMENT naming the field, and the gateway serves on.
REST over ASGI, gRPC over a real socket, both in front of the fake services."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.grpc_util import server_options
from gateway.grpc_server import add_to_server
from protos import generate_pb2, generate_pb2_grpc
from tests.gateway.conftest import asgi_client, generate_status

M = "fake-model"
CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": M, "prompt": "abc"}
U32, I63 = 1 << 32, 1 << 63


@pytest.fixture
def stack(rest_stack):
    return rest_stack


_client = asgi_client


@pytest.fixture
async def rest(stack):
    async with _client(stack) as c:
        yield c


@pytest.fixture
async def grpc_stub(stack):
    server = grpc.aio.server(options=server_options())
    add_to_server(server, stack.core, None)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_send_message_length", 64 << 20)])
    yield generate_pb2_grpc.GenerationStub(ch), ch
    await ch.close()
    await server.stop(None)


# ---- REST: every numeric field range-checked, finite floats only ------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 1e12}, "max_tokens"), ({"max_tokens": 10 ** 12}, "max_tokens"),
    ({"max_tokens": U32}, "max_tokens"), ({"seed": I63}, "seed"), ({"seed": -I63 - 1}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [U32]}, "stop_token_ids"),
    ({"stop_token_ids": [600]}, "stop_token_ids"),  # beyond the vocabulary (512)
    ({"temperature": 1e308}, "temperature"), ({"temperature": 101}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1 << 31}, "top_k"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1e-30}, "top_p"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"priority": 1 << 31}, "priority"),
    ({"ttft_ms": -1}, "ttft_ms"), ({"slo": {"tpot_ms": -1}}, "slo.tpot_ms"),
    ({"logprobs": 6}, "logprobs"), ({"n": 2}, "n"), ({"stop": [""]}, "stop"),
    ({"request_id": "r" * 257}, "request_id"), ({"stream_options": {"include_usage": 1}},
                                          "stream_options.include_usage"),
])
async def test_out_of_range_fields_are_400_naming_them(rest, extra, param):
    r = await rest.post("/v1/completions", json={**COMP, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param.split('[')[0]}" in err["message"], err


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"max_completion_tokens": U32},
                                                               "max_completion_tokens"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
])
async def test_chat_fields_are_400_naming_them(rest, extra, param):
    r = await rest.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


@pytest.mark.parametrize("raw", [
    b'{"model": "fake-model", "prompt": "abc", "temperature": NaN}',
    b'{"model": "fake-model", "prompt": "abc", "temperature": Infinity}',
    b'{"model": "fake-model", "prompt": "abc", "top_p": -Infinity}',
    b'{"model": "fake-model", "prompt": "abc", "temperature": 1e400}',
    b'{"model": "fake-model", "prompt": "\\ud800"}',  # a lone surrogate
    b'{"model": "fake-model", "prompt": "a\\udc00b"}',
    b'{"model": "fake-model", "prompt": "\xed\xa0\x80"}',  # the same, as (invalid) UTF-8
    b'{"model": "fake-model", "prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    b"[" * 20000 + b"]" * 20000,
])
async def test_hostile_json_is_400(stack, raw):
    async with _client(stack, max_body_bytes=1 << 20) as c:
        r = await c.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        chat = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}'
        r = await c.post("/v1/chat/completions", content=chat,
                         headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = await c.post("/v1/completions", json={**COMP, "max_tokens": 2})
        assert r.status_code == 200  # still serving


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_content_type_is_enforced(rest, ctype, path):
    r = await rest.post(path, content=b'{"model": "fake-model", "prompt": "abc"}',
                        headers={"content-type": ctype})
    assert r.status_code == 415, r.text
    assert "Content-Type must be application/json" in r.json()["error"]["message"]


async def test_json_content_types_accepted(rest):
    for ctype in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        h = {"content-type": ctype} if ctype else {}
        r = await rest.post("/v1/completions", content=b'{"model": "fake-model", "prompt": "a", '
                                                       b'"max_tokens": 2}', headers=h)
        assert r.status_code == 200, (ctype, r.text)


# ---- max_tokens beyond the context ---------------------------------------------------------

async def test_max_tokens_beyond_context_is_400_by_default(rest):
    r = await rest.post("/v1/completions", json={**COMP, "max_tokens": 253})
    assert r.status_code == 200  # 3 + 253 = 256 fits
    r = await rest.post("/v1/completions", json={**COMP, "max_tokens": 254, "stream": True})
    assert r.status_code == 400
    r = await rest.post("/v1/completions", json={**COMP, "max_tokens": 100_000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert "maximum context length is 256" in err["message"] and "100003" in err["message"]
    r = await rest.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


async def test_max_tokens_beyond_context_capped_by_flag(stack):
    async with _client(stack, max_tokens_over_context="cap") as c:
        r = await c.post("/v1/completions", json={**COMP, "max_tokens": 100_000})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == 256 - 3 and r.json()["choices"][0]["finish_reason"] == "length"


def test_max_tokens_over_context_flag():
    from gateway.config import GatewayConfig, add_args

    import argparse
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args([]).max_tokens_over_context == "error"
    assert p.parse_args(["--max-tokens-over-context", "cap"]).max_tokens_over_context == "cap"
    with pytest.raises(ValueError):
        GatewayConfig(max_tokens_over_context="truncate")


# ---- duplicate request ids --------------------------------------------------------------------

async def test_empty_request_id_means_unset(rest):
    r = await rest.post("/v1/completions", json={**COMP, "max_tokens": 2, "request_id": "",
                                                 "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req-")


async def test_duplicate_request_id_is_409_and_the_first_goes_on(stack):
    stack.decodes[0].step_s = 0.01
    async with _client(stack) as c:
        body = {**COMP, "max_tokens": 30, "request_id": "dup-1"}
        first = asyncio.create_task(c.post("/v1/completions", json=body))
        for _ in range(500):  # until the first is decoding (a loaded machine takes longer)
            if stack.decodes[0].running:
                break
            await asyncio.sleep(0.01)
        assert stack.decodes[0].running
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["param"] == "request_id" and "in use" in err["message"]
        r1 = await first
        assert r1.status_code == 200 and r1.json()["usage"]["completion_tokens"] == 30
        r = await c.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200  # the id is free again once the first ended


async def test_duplicate_request_id_grpc_already_exists(stack, grpc_stub):
    stub, _ = grpc_stub
    stack.decodes[0].step_s = 0.01
    req = generate_pb2.GenerateRequest(request_id="dup-2", prompt="abc", max_tokens=30)
    first = stub.Generate(req)
    got = [await first.read()]
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.Generate(req):
            pass
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    while (r := await first.read()) is not grpc.aio.EOF:
        got.append(r)
    assert sum(len(r.token_ids) for r in got) == 30
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


# ---- gRPC: the same rules after conversion --------------------------------------------------

_status = generate_status


S = generate_pb2.SamplingParams
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw,field", [
    ({"sampling": S(repetition_penalty=NAN)}, "sampling.repetition_penalty"),
    ({"sampling": S(temperature=NAN)}, "sampling.temperature"),
    ({"sampling": S(temperature=INF)}, "sampling.temperature"),
    ({"sampling": S(temperature=1e308)}, "sampling.temperature"),  # float32: inf
    ({"sampling": S(top_p=NAN)}, "sampling.top_p"),
    ({"sampling": S(temperature=1000)}, "sampling.temperature"),
    ({"sampling": S(top_k=-5)}, "sampling.top_k"),
    ({"sampling": S(logprobs=21)}, "sampling.logprobs"),
    ({"sampling": S(min_tokens=-1)}, "sampling.min_tokens"),
    ({"max_tokens": U32 - 1}, "max_tokens"),
    ({"stop_token_ids": [U32 - 1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"sampling": S(seed=-5, presence_penalty=2.5)}, "sampling.presence_penalty"),
    ({"messages": generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
        role="bot", content="x")])}, "messages[0].role"),
    ({"messages": generate_pb2.ChatMessages()}, "messages"),
])
async def test_grpc_invalid_argument_naming_the_field(grpc_stub, kw, field):
    stub, _ = grpc_stub
    if "messages" not in kw:
        kw = {"prompt": "abc", **kw}
    code, details = await _status(stub, generate_pb2.GenerateRequest(**kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details, details


@pytest.mark.parametrize("method", ["Generate", "Tokenize"])
@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x12\x02\xff\xfe", b"\x0a\x85"])
async def test_grpc_malformed_protobuf_is_invalid_argument(grpc_stub, method, raw):
    _, ch = grpc_stub
    path = f"/splitserve.v1.Generation/{method}"
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        if method == "Generate":
            async for _ in ch.unary_stream(path, **ident)(raw, timeout=10):
                pass
        else:
            await ch.unary_unary(path, **ident)(raw, timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    assert "not a valid splitserve.v1." in ei.value.details()


async def test_grpc_tokenize_and_prompt_are_bounded(grpc_stub):
    stub, _ = grpc_stub
    big = "x" * (30 << 20)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Tokenize(generate_pb2.TokenizeRequest(text=big), timeout=20)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too large" in ei.value.details()
    code, details = await _status(stub, generate_pb2.GenerateRequest(prompt=big))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'prompt' is too large" in details
    msgs = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=big)])
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Tokenize(generate_pb2.TokenizeRequest(messages=msgs), timeout=20)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - t0 < 5.0  # the three answered without tokenizing 30 MiB
    r = await stub.Tokenize(generate_pb2.TokenizeRequest(text="ab"), timeout=5)
    assert list(r.token_ids) == [97, 98]


async def test_grpc_and_rest_accept_the_same_roles(rest, grpc_stub):
    stub, _ = grpc_stub
    for role in ("system", "user", "assistant", "tool", "developer", "bot", "User", ""):
        r = await rest.post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 2, "messages": [{"role": role, "content": "x"}]})
        msgs = [generate_pb2.ChatMessage(role=role, content="x")]
        code, _ = await _status(stub, generate_pb2.GenerateRequest(
            max_tokens=2, messages=generate_pb2.ChatMessages(messages=msgs)))
        assert (r.status_code == 200) == (code == grpc.StatusCode.OK), (role, r.text, code)
        assert r.status_code in (200, 400)


async def test_long_prompt_is_tokenized_off_the_event_loop(stack):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    async with _client(stack, max_body_bytes=8 << 20) as c:
        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={**COMP, "prompt": "ab " * (100 << 10)})
        dt = time.monotonic() - t0
        t.cancel()
    assert r.status_code == 400 and "too long" in r.text
    # the loop ran on while the 300 KiB prompt was tokenized (encode on the loop: ~no ticks)
    assert ticks >= max(3, 0.05 * dt / 0.005), (ticks, dt)
