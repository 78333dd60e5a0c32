"""Fuzz both public fronts of a real gateway process (python -m gateway, tiny dummy model's
tokenizer) in front of the fake prefill / decode services (tests/gateway/fake_backends.py: a
process of their own, so generation costs nothing): >= 1,000 hypothesis-generated requests
per front, no answer >= 500 (gRPC: only OK / INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED),
no hang (each request has 10 s), no SSE error event of a server fault, nothing left reserved
on the fake decode afterwards and the gateway still serving."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.gateway import fuzz_strategies as fs
from protos import common_pb2, decode_pb2_grpc
from tests.harness import gateway_over_fakes

N = 1000
FUZZ = settings(max_examples=N, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
GRPC_OK = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}


def _held(address: str) -> tuple[int, int]:
    """(reservations, streams) the fake decode holds."""
    with grpc.insecure_channel(address) as ch:
        load = decode_pb2_grpc.DecodeStub(ch).Load(common_pb2.LoadRequest(), timeout=10)
    return load.reserved, load.running


@pytest.fixture(scope="module")
def gateway():
    with gateway_over_fakes([], ["--http-port", "0", "--max-model-len", "256"]) as got:
        yield got


def _settled(gw, decode: str) -> None:
    """Nothing held on the fake decode (the gateway released / aborted every reservation)
    and the gateway answers a plain request."""
    deadline = time.monotonic() + 10
    while _held(decode) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held(decode) == (0, 0)
    r = httpx.post(f"http://127.0.0.1:{gw.ports[1]}/v1/completions", timeout=10,
                   json={"model": fs.MODEL, "prompt": "abc", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.timeout(300)
def test_fuzz_rest(gateway):
    gw, decode = gateway
    seen: dict[int, int] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{gw.ports[1]}", timeout=10) as c:
        @FUZZ
        @given(fs.rest_request)
        def one(req):
            path, body, ctype = req
            headers = {"content-type": ctype} if ctype else {}
            try:
                r = c.post(path, content=body, headers=headers)
            except httpx.TimeoutException:
                pytest.fail(f"no answer in 10 s: {path} {body[:300]!r}")
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, body[:300], r.text[:500])
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                assert '"code": "internal"' not in r.text, r.text[-500:]
        one()
    assert sum(seen.values()) >= N, seen
    assert seen.get(200, 0) >= 50 and sum(v for k, v in seen.items() if k != 200) >= 50, seen
    _settled(gw, decode)


@pytest.mark.timeout(300)
def test_fuzz_grpc(gateway):
    gw, decode = gateway
    seen: dict[str, int] = {}
    with grpc.insecure_channel(f"127.0.0.1:{gw.ports[0]}") as ch:
        call = fs.raw_grpc_caller(ch, timeout=10)

        @FUZZ
        @given(fs.grpc_request)
        def one(req):
            code, details = call(req)
            assert code == grpc.StatusCode.OK or code in GRPC_OK, (req[0], req[1][:300], code, details)
            seen[code.name] = seen.get(code.name, 0) + 1
        one()
    assert sum(seen.values()) >= N, seen
    assert seen.get("OK", 0) >= 50 and seen.get("INVALID_ARGUMENT", 0) >= 50, seen
    _settled(gw, decode)
