"""REST bridge over fake backends: OpenAI validation -> 400 messages, SSE framing, 429."""
import json

import httpx
import pytest

from gateway.admission import AdmissionConfig
from gateway.rest import build_app
from tests.gateway.conftest import make_stack


@pytest.fixture
async def client():
    s = await make_stack(admission=AdmissionConfig(prefill_tokens_per_s=1000.0))
    app = build_app(s.core, max_body_bytes=4096)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        c.stack = s
        yield c
    await s.close()


def sse_events(body: str) -> list:
    assert body.endswith("\n\n")
    frames = body.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


async def test_completion_non_stream(client):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "abc",
                                                    "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "text_completion" and j["choices"][0]["text"] == "defg"
    assert j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_token_ids_and_logprobs(client):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": [97, 98],
                                                    "max_tokens": 3, "logprobs": 1})
    j = r.json()
    assert j["choices"][0]["text"] == "cde"
    lp = j["choices"][0]["logprobs"]
    assert lp["tokens"] == ["c", "d", "e"] and len(lp["token_logprobs"]) == 3
    assert lp["text_offset"] == [0, 1, 2]


async def test_chat_stream_sse_framing(client):
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[0]["object"] == "chat.completion.chunk"
    assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [e["choices"][0]["finish_reason"] for e in ev if e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 5
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"])
    assert len(text) == 5


async def test_chat_non_stream(client):
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 1})
    j = r.json()
    assert r.status_code == 200, j
    assert j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant"
    assert len(j["choices"][0]["logprobs"]["content"]) == 3


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, "'prompt' is empty"),
    ("/v1/completions", {"model": "fake-model"}, "'prompt' is required"),
    ("/v1/completions", {"prompt": "x"}, "'model' is required"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x" * 300}, "prompt is too long"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": "5"},
     "'max_tokens' must be an integer, got string"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "temperature": True},
     "'temperature' must be a number, got boolean"),
    ("/v1/completions", {"model": "fake-model", "prompt": 5}, "'prompt' must be a string"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "n": 2}, "'n' must be 1"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "stop": [1]}, "'stop' must be"),
    ("/v1/completions", [1, 2], "must be a JSON object"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": []}, "'messages' must be a non-empty"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "bot", "content": "x"}]},
     "got 'bot'"),
])
async def test_bad_requests_are_400_with_message(client, path, body, needle):
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"


async def test_bad_json_and_oversized_body(client):
    r = await client.post("/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x" * 10000})
    assert r.status_code == 400 and "too large" in r.json()["error"]["message"]
    # still serving afterwards
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 200


async def test_tiny_slo_is_429_with_retry_after(client):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "abc" * 30,
                                                    "max_tokens": 2, "ttft_ms": 1, "stream": True})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    msg = r.json()["error"]["message"]
    assert "predicted TTFT" in msg and "ttft_ms=1" in msg


async def test_models_health_metrics(client):
    j = (await client.get("/v1/models")).json()
    assert j["data"][0]["id"] == "fake-model"
    assert (await client.get("/health")).status_code == 200
    await client.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 2})
    m = (await client.get("/metrics")).text
    assert "splitserve_time_to_first_token_seconds_bucket" in m
    assert 'splitserve_admission_decisions_total{decision="admit"}' in m
