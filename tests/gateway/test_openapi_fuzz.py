"""Property-based tests of the REST front from its own OpenAPI document (schemathesis): requests
generated from /openapi.json (bodies valid by the schema and ones that break it) to a real
gateway process in front of the fake services (test_fuzz's fixture) answer below 500, with a
JSON body (or an SSE stream of JSON chunks); errors in OpenAI's shape."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway import fuzz_strategies as fs
from tests.gateway.test_fuzz import _settled, gateway  # noqa: F401 - the module's fixture

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (requirements-test.txt)")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

EXAMPLES = 100  # per operation, valid and invalid bodies mixed
OPERATIONS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"}


@pytest.fixture(scope="module")
def api_schema(gateway):  # noqa: F811
    gw, _ = gateway
    base = f"http://127.0.0.1:{gw.ports[1]}"
    raw = httpx.get(base + "/openapi.json", timeout=10).json()
    raw["paths"] = {p: v for p, v in raw["paths"].items() if p in OPERATIONS}
    for op in raw["paths"].values():
        for m in op.values():
            body = m.get("requestBody", {}).get("content", {}).get("application/json", {})
            _narrow(body.get("schema", {}))
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=base, request_timeout=10)
    return schema


TEXT = {"type": "string", "minLength": 1, "maxLength": 64}
TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 511},
          "minItems": 1, "maxItems": 32}


def _narrow(body: dict) -> None:
    """The free-form fields (`Any` in gateway/schemas.py) as a well-behaved client fills them and
    the served model required, so valid bodies reach generation; the negative mode breaks them."""
    props = body.get("properties", {})
    if "model" in props:
        props["model"] = {"enum": [fs.MODEL]}
        body.setdefault("required", []).append("model")
    if "prompt" in props and "messages" not in props:  # completions (tokenize keeps its string)
        props["prompt"] = {"oneOf": [TEXT, TOKENS]}
    if "stop" in props:
        props["stop"] = {"oneOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 4}]}
    msg = props.get("messages", {})
    for m in [msg, *msg.get("anyOf", [])]:
        if m.get("type") == "array":
            m["items"]["properties"]["content"] = TEXT


def _operations(api_schema) -> dict:
    return {op.path: op for op in (r.ok() for r in api_schema.get_all_operations())}


def test_every_operation_has_a_body_schema(api_schema):
    ops = _operations(api_schema)
    assert set(ops) == OPERATIONS
    for path in OPERATIONS - {"/v1/models"}:
        assert ops[path].body, f"{path}: no request body in /openapi.json"


def _check(case) -> None:
    r = case.call_and_validate(checks=[not_a_server_error])  # raises with a curl to replay it
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text
    elif "text/event-stream" in " ".join(r.headers.get("content-type") or []):  # list values
        # schemathesis keeps the first events of a stream only: each kept event is a JSON chunk
        # (or the closing [DONE])
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events, r.text[:300]
        for e in events:
            assert e == "[DONE]" or isinstance(json.loads(e), dict), e[:300]
    else:
        assert isinstance(r.json(), dict), r.text[:300]


# NOTE: hypothesis over each operation's strategy rather than schemathesis.pytest.from_fixture,
# whose parametrize reads request.node._nodeid, gone in pytest 9.2 (AttributeError)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(OPERATIONS))
def test_rest_front_from_its_openapi_schema(api_schema, path):
    op = _operations(api_schema)[path]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
    def one(case):
        _check(case)

    one()


def test_integral_numbers_are_integers(gateway):  # noqa: F811 - as the published schema says
    gw, _ = gateway
    url = f"http://127.0.0.1:{gw.ports[1]}/v1/completions"
    r = httpx.post(url, timeout=10, json={"model": fs.MODEL, "prompt": [5.0, 6], "max_tokens": 3.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    for bad in ({"max_tokens": 3.5}, {"max_tokens": "3"}, {"prompt": [5.5]}):
        r = httpx.post(url, timeout=10, json={"model": fs.MODEL, "prompt": [5], **bad})
        assert r.status_code == 400, (bad, r.text)


def test_gateway_settles_after(gateway):  # noqa: F811
    gw, decode = gateway
    _settled(gw, decode)
