"""Failures with real processes: a dead prefill replica is routed around; a killed decode ends
the client's stream with UNAVAILABLE within seconds (gRPC) and an error event (REST)."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from protos import generate_pb2, generate_pb2_grpc
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def services():
    s = harness.start_stack(harness.TINY_CPU, n_prefill=2)
    yield s
    s.stop()


def req(n_tokens, ids=(5, 6, 7, 8, 9)):
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(ids)), max_tokens=n_tokens, ignore_eos=True,
        sampling=generate_pb2.SamplingParams(temperature=0.0))


async def run(stub, r):
    return [x async for x in stub.Generate(r)]


async def test_dead_prefill_replica_is_routed_around(services):
    async with grpc.aio.insecure_channel(services.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        want = [t for x in await run(stub, req(6)) for t in x.token_ids]
        services.prefills[0].stop(kill=True)
        for i in range(4):  # whichever replica routing picks first, every request succeeds
            got = [t for x in await run(stub, req(6)) for t in x.token_ids]
            assert got == want, f"request {i}"
        # the requests may all have gone to the live replica: the dead one is then found by
        # the load poll (every 0.5 s), so /health is eventually consistent -- wait for it
        deadline = time.monotonic() + 10
        async with httpx.AsyncClient(base_url=services.http_url, timeout=10) as c:
            while True:
                h = (await c.get("/health")).json()
                if any(not p["healthy"] for p in h["prefill"]) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        assert any(not p["healthy"] for p in h["prefill"]) and any(p["healthy"] for p in h["prefill"])


async def test_killed_decode_gives_unavailable_fast(services):
    async with grpc.aio.insecure_channel(services.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        call = stub.Generate(req(240))
        async for _ in call:
            break
        services.decodes[0].stop(kill=True)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
        assert time.monotonic() - t0 < 5
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
        # new requests fail fast with a clear UNAVAILABLE too
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await run(stub, req(4))
        assert time.monotonic() - t0 < 5
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in ei.value.details()
    async with httpx.AsyncClient(base_url=services.http_url, timeout=10) as c:
        r = await c.post("/v1/completions", json={"model": "dummy-tiny-llama", "prompt": [5, 6],
                                                  "max_tokens": 4})
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
