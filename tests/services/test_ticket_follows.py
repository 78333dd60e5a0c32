"""Prefill.Prefill with ticket_follows: the prompt runs before decode's ticket, which comes by
Prefill.Ticket (real prefill and decode processes, shm pool, tiny model). The output equals
the sequential path's whether the ticket comes during the prompt, after it, or before the
Prefill; a missing, refused, mismatched or cancelled ticket ends the request with an explicit
error and frees the blocks on both sides. Through a real gateway, --reserve-overlap auto sends
prompts this way once the pair has handed KV over through the pool; off never does."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.convert import params_to_pb
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, prefill_pb2
from tests import harness
from tests.services.client import Client
from tests.services.test_disagg_e2e import _colocated
from tests.services.test_pool_early_answer import _freed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TIMEOUT_S = 2.0  # prefill's --transfer-timeout-s: how long a Prefill waits for its ticket
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(40 + 9 * i, 90 + 9 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def pair():
    with harness.service_pair(["--transfer-timeout-s", str(TIMEOUT_S)],
                              ["--reservation-timeout-s", "5"]) as p:
        yield p


@pytest.fixture(scope="module")
def want():
    return _colocated(PROMPTS, PARAMS)


async def _reserve(c: Client, rid: str, prompt) -> common_pb2.TransferTicket:
    return (await c.decode.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
        max_tokens=PARAMS.max_tokens), timeout=10)).ticket


def _prefill(c: Client, rid: str, prompt, ticket=None):
    req = prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                     params=params_to_pb(PARAMS))
    if ticket is None:
        req.ticket_follows = True
    else:
        req.ticket.CopyFrom(ticket)
    return c.prefill.Prefill(req, timeout=30)


async def _ticket(c: Client, rid: str, ticket):
    return await c.prefill.Ticket(prefill_pb2.TicketRequest(request_id=rid, ticket=ticket), timeout=10)


async def _tokens(c: Client, rid: str, ticket, prompt, pre) -> list[int]:
    toks = [pre.first_token_id]
    async for m in c.decode.Decode(decode_pb2.DecodeRequest(
            request_id=rid, transfer_id=ticket.transfer_id, prompt_token_ids=prompt,
            first_token_id=pre.first_token_id, params=params_to_pb(PARAMS)), timeout=60):
        toks += list(m.token_ids)
    return toks


async def test_ticket_during_after_and_before_the_prompt(pair, want):
    pre_p, dec_p = pair
    c = Client(pre_p.address, dec_p.address)
    try:
        free0 = (await c.decode.Load(common_pb2.LoadRequest(), timeout=5)).num_free_blocks
        # the sequential path first (proves the pool pair)
        t = await _reserve(c, "seq", PROMPTS[0])
        pre = await _prefill(c, "seq", PROMPTS[0], t)
        assert pre.kv_backend == "shm" and pre.timings.ticket_wait_ms == 0
        assert await _tokens(c, "seq", t, PROMPTS[0], pre) == want[0]
        # the ticket comes well after the first token: the Prefill waited for it
        call = _prefill(c, "late", PROMPTS[1])
        await asyncio.sleep(0.5)
        t = await _reserve(c, "late", PROMPTS[1])
        await _ticket(c, "late", t)
        pre = await call
        assert pre.kv_backend == "shm" and pre.timings.ticket_wait_ms > 100, pre.timings
        assert await _tokens(c, "late", t, PROMPTS[1], pre) == want[1]
        # the ticket comes first (the two RPCs race): kept until its Prefill registers
        t = await _reserve(c, "early", PROMPTS[2])
        await _ticket(c, "early", t)
        pre = await _prefill(c, "early", PROMPTS[2])
        assert pre.timings.ticket_wait_ms < 100, pre.timings
        assert await _tokens(c, "early", t, PROMPTS[2], pre) == want[2]
        await _freed(c, free0, 8.0)
    finally:
        await c.close()


async def test_no_ticket_cancel_and_bad_tickets_end_explicitly(pair):
    pre_p, dec_p = pair
    c = Client(pre_p.address, dec_p.address)
    try:
        free0 = (await c.decode.Load(common_pb2.LoadRequest(), timeout=5)).num_free_blocks
        # no ticket: the Prefill gives up after its transfer timeout, naming what it waited for
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _prefill(c, "none", PROMPTS[0])
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no ticket" in e.value.details()
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 5
        # the caller leaves while the Prefill waits for its ticket
        call = _prefill(c, "gone", PROMPTS[0])
        await asyncio.sleep(0.5)
        call.cancel()
        await _freed(c, free0, 8.0)
        # a ticket of another layout is refused at once, naming the layout
        t = await _reserve(c, "layout", PROMPTS[0])
        bad = common_pb2.TransferTicket()
        bad.CopyFrom(t)
        bad.layout.num_layers += 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _ticket(c, "layout", bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "layout" in e.value.details()
        # the same request's ticket twice
        await _ticket(c, "layout", t)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _ticket(c, "layout", t)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # a ticket reserved for another prompt: refused after the prompt, blocks freed
        call = _prefill(c, "layout", PROMPTS[3])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_digest" in e.value.details(), e.value.details()
        await c.decode.Release(decode_pb2.ReleaseRequest(request_id="layout", transfer_id=t.transfer_id,
                                                         reason="test"), timeout=5)
        await _freed(c, free0, 8.0)
    finally:
        await c.close()


def _hist_count(proc, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name + "_count")


async def _requests(stack, n: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        out = []
        for i in range(n):  # one at a time: the first proves the pair
            r = await c.post("/v1/completions", json={
                "model": model, "prompt": f"request {i}: tell me more", "max_tokens": 8,
                "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_gateway_reserve_overlap(mode):
    s = harness.start_stack(harness.TINY_CPU, gateway_args=["--reserve-overlap", mode])
    try:
        out = asyncio.run(_requests(s, 4))
        assert all(o["usage"]["completion_tokens"] == 8 for o in out)
        n = _hist_count(s.prefills[0], "splitserve_kv_ticket_wait_seconds")
        assert n == (3 if mode == "auto" else 0), n
    finally:
        s.stop()
