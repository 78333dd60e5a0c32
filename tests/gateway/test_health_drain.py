"""The gateway's health and drain over fakes: a replica marked down costs new requests nothing
(UNAVAILABLE + Retry-After at once), /health follows the replicas the topology needs, and a
draining core refuses new requests while one running finishes."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from gateway.rest import build_app
from gateway.types import GatewayError
from tests.gateway.test_core_fakes import collect, req


async def _health(core) -> tuple[int, dict]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(core)),
                                 base_url="http://t") as c:
        r = await c.get("/health")
        return r.status_code, r.json()


async def test_a_down_replica_fails_new_requests_at_once(stack):
    core = stack.core
    core.decode.replicas[0].mark_down("Load: DEADLINE_EXCEEDED")  # e.g. frozen
    t0 = time.monotonic()
    with pytest.raises(GatewayError) as ei:
        await collect(core, req(core, "abc", max_tokens=3))
    assert time.monotonic() - t0 < 0.5
    e = ei.value
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.retry_after_s and "decode" in e.message
    assert not stack.decodes[0].reserved  # nothing was sent to it
    assert (await _health(core))[0] == 503


async def test_health_needs_prefill_only_when_split(stack):
    core = stack.core
    core.prefill.replicas[0].mark_down("gone")
    code, body = await _health(core)
    assert code == 503 and body["status"] == "degraded"
    core.prefill_on_decode = "always"  # colocated: prompts are prefilled on decode
    code, body = await _health(core)
    assert code == 200 and body["status"] == "ok"


async def test_draining_refuses_new_requests_and_lets_running_ones_finish():
    from tests.gateway.conftest import make_stack

    s = await make_stack(decode_step_s=0.01)
    try:
        core = s.core
        running = asyncio.ensure_future(collect(core, req(core, "abc", max_tokens=30)))
        while not core.num_active:
            await asyncio.sleep(0.005)
        core.start_drain()
        with pytest.raises(GatewayError) as ei:
            await collect(core, req(core, "abc", max_tokens=3))
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and ei.value.retry_after_s >= 1
        assert (await _health(core))[1]["status"] == "draining"
        assert await core.wait_idle(10)
        chunks = await running
        assert sum(len(c.token_ids) for c in chunks) == 30 and chunks[-1].finish_reason == "length"
    finally:
        await s.close()
