"""Prefill on the decode replica (--prefill-on-decode): the gateway skips Reserve / Prefill and
the decode engine runs the prompt in its own batches. Greedy output equals the engine alone,
on gRPC and REST, streamed with a first-token time; the prefill replica sees no request; a
client that leaves mid-stream frees decode's blocks. The auto rule: only replicas sharing a GPU."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from gateway.core import GatewayCore
from gateway.routing import Replica, Route
from tests import harness
from tests.e2e.test_gateway_e2e import MODEL, PROMPTS, engine_greedy, greedy_req, load_of, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def services():
    s = harness.start_stack(harness.TINY_CPU, gateway_args=["--prefill-on-decode", "always"])
    yield s
    s.stop()


async def test_prefilled_on_decode_equals_the_engine(services):
    import grpc

    from protos import generate_pb2_grpc

    want, _ = engine_greedy(PROMPTS, 12)
    async with grpc.aio.insecure_channel(services.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for i, p in enumerate(PROMPTS):
            resps = [r async for r in stub.Generate(greedy_req(p, 12))]
            assert [t for r in resps for t in r.token_ids] == want[i], services.logs()
            last = resps[-1]
            assert last.usage.completion_tokens == 12 and last.timings.ttft_ms > 0
        async def one(p):
            return [t async for r in stub.Generate(greedy_req(p, 12)) for t in r.token_ids]
        got = await asyncio.gather(*(one(p) for p in PROMPTS))
        assert got == want
        call = stub.Generate(greedy_req(PROMPTS[1], 200))
        async for r in call:
            if r.token_ids:
                break
        call.cancel()
    async with httpx.AsyncClient(base_url=services.http_url, timeout=30) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    await wait_idle(services)
    pl, _ = await load_of(services)
    assert pl.tokens_per_s == 0 and pl.prefix_hit_rate == 0  # prefill never ran a prompt


def _core(mode: str) -> GatewayCore:
    c = GatewayCore.__new__(GatewayCore)
    c.prefill_on_decode = mode
    c.decode = SimpleNamespace(replicas=[Replica("d:1", "decode")])
    c.predictor = None
    return c


@pytest.mark.parametrize("mode, pre_dev, dec_dev, here", [
    ("auto", "cuda:GPU-a", "cuda:GPU-a", True),     # one GPU: time-shared anyway
    ("auto", "cuda:GPU-a", "cuda:GPU-b", False),    # two GPUs: split
    ("auto", "cpu:host", "cpu:host", False),        # CPU: each service has its own cores
    ("never", "cuda:GPU-a", "cuda:GPU-a", False),
    ("always", "cpu:host", "cuda:GPU-b", True),
])
def test_the_rule(monkeypatch, mode, pre_dev, dec_dev, here):
    import gateway.core as core

    monkeypatch.setattr(core, "order_decode", lambda reps, pred: reps)
    c = _core(mode)
    c.decode.replicas[0].load.device_id = dec_dev
    p = Replica("p:1", "prefill")
    p.load.device_id = pre_dev
    got = c._decode_here(Route(prefill=p))
    assert (got is c.decode.replicas[0]) == here
