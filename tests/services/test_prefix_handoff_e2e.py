"""Prefix-aware KV handoff between real prefill and decode processes: a second prompt sharing
three full blocks with the first moves only its last block (shm pool and grpc streaming), the
decode metric counts the blocks not sent, greedy output equals the colocated engine, and a
decode run with --no-prefix-caching moves every block, a reservation released after its KV
arrived (the first token ended the request) still leaves its blocks for the next one. Bad input
-> INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.convert import params_to_pb
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, prefill_pb2
from tests import harness
from tests.services.client import Client
from tests.services.test_disagg_e2e import _colocated

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SHARED = list(range(3, 3 + 48))  # 3 full blocks of 16
PROMPTS = [SHARED + [90, 91, 92], SHARED + [80, 81, 82, 83, 84, 85]]  # 4 blocks each
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def services():
    with harness.service_group(
            prefill=("prefill_svc", []),
            shm=("decode_svc", []),
            grpc=("decode_svc", ["--kv-transfer-backend", "grpc"]),
            off=("decode_svc", ["--no-prefix-caching"])) as procs:
        yield procs


def _reused(dec) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{dec.metrics_port}/metrics", timeout=5).read().decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return got["splitserve_kv_prefix_reused_blocks_total"], got["splitserve_kv_prefix_reused_bytes_total"]


async def _two(pre, dec, tag):
    c = Client(pre.address, dec.address)
    try:
        out = []
        for i, p in enumerate(PROMPTS):  # one after the other: the first's blocks are published
            ticket, resp, call = await c.start(f"{tag}{i}", p, GREEDY)
            toks = [resp.first_token_id]
            async for m in call:
                toks += list(m.token_ids)
            out.append((toks, ticket.num_cached_blocks, resp.kv_bytes, resp.kv_backend))
        return out
    finally:
        await c.close()


@pytest.mark.parametrize("decode,backend", [("shm", "shm"), ("grpc", "grpc")])
async def test_second_prompt_sends_only_the_blocks_decode_lacks(services, decode, backend):
    want = _colocated(PROMPTS, GREEDY)
    got = await _two(services["prefill"], services[decode], decode)
    assert [g[0] for g in got] == want
    assert [g[3] for g in got] == [backend, backend]
    assert [g[1] for g in got] == [0, 3]
    assert got[1][2] * 4 == got[0][2]  # 1 of 4 blocks moved
    assert _reused(services[decode]) == (3, got[0][2] * 3 / 4)


async def test_no_prefix_caching_on_decode_sends_every_block(services):
    got = await _two(services["prefill"], services["off"], "off")
    assert [g[0] for g in got] == _colocated(PROMPTS, GREEDY)
    assert [g[1] for g in got] == [0, 0] and got[0][2] == got[1][2] > 0
    assert _reused(services["off"]) == (0, 0)


async def test_bad_input_is_invalid_argument(services):
    pre, dec = services["prefill"], services["shm"]
    await _two(pre, dec, "warm")  # SHARED is held
    c = Client(pre.address, dec.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.decode.Reserve(decode_pb2.ReserveRequest(
                request_id="short", num_prompt_tokens=5, prompt_token_ids=[1, 2]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in e.value.details()
        p, pp = PROMPTS[1], params_to_pb(GREEDY)
        # a ticket claiming more held blocks than a prompt can have (only the last one is sent)
        res = await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="forged", num_prompt_tokens=len(p), prompt_token_ids=p), timeout=5)
        res.ticket.num_cached_blocks = 4
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id="forged", prompt_token_ids=p, params=pp, ticket=res.ticket), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_cached_blocks" in e.value.details()
        await c.decode.Release(decode_pb2.ReleaseRequest(request_id="forged"), timeout=5)
        # prefill refuses a prompt other than the one decode reserved for (its digest is signed)
        res = await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="other", num_prompt_tokens=len(p), prompt_token_ids=p), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id="other", prompt_token_ids=[7] + p[1:], params=pp, ticket=res.ticket), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_digest" in e.value.details()
        await c.decode.Release(decode_pb2.ReleaseRequest(request_id="other"), timeout=5)
        # Decode's prompt must be Reserve's over the blocks decode holds
        ticket = (await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="swap", num_prompt_tokens=len(p), prompt_token_ids=p), timeout=5)).ticket
        assert ticket.num_cached_blocks == 3
        resp = await c.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="swap", prompt_token_ids=p, params=pp, ticket=ticket), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in c.decode.Decode(decode_pb2.DecodeRequest(
                    request_id="swap", transfer_id=ticket.transfer_id, prompt_token_ids=[7] + p[1:],
                    first_token_id=resp.first_token_id, params=pp), timeout=10):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Reserve" in e.value.details()
        for _ in range(50):  # every block is free again (the held ones back on the cached LRU)
            load = await c.decode.Load(common_pb2.LoadRequest(), timeout=5)
            if load.kv_usage == 0 and load.reserved == 0:
                break
            await asyncio.sleep(0.1)
        assert load.kv_usage == 0 and load.reserved == 0, load
    finally:
        await c.close()


async def test_released_after_arrival_still_publishes(services):
    """The gateway releases a reservation whose first token ended the request (no Decode
    comes): its KV arrived whole, so its prompt's full blocks serve the next reservation."""
    pre, dec = services["prefill"], services["shm"]
    p = list(range(200, 200 + 40))  # 2 full blocks + 8 tokens, a prefix no other test sends
    c = Client(pre.address, dec.address)
    try:
        pp = params_to_pb(GREEDY)
        ticket = (await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="one", num_prompt_tokens=len(p), prompt_token_ids=p), timeout=5)).ticket
        await c.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="one", prompt_token_ids=p, params=pp, ticket=ticket), timeout=10)
        assert (await c.decode.Release(decode_pb2.ReleaseRequest(
            request_id="one", transfer_id=ticket.transfer_id, reason="finished", await_kv=True),
            timeout=5)).found
        again = (await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="two", num_prompt_tokens=len(p), prompt_token_ids=p), timeout=5)).ticket
        assert again.num_cached_blocks == 2
        await c.decode.Release(decode_pb2.ReleaseRequest(request_id="two"), timeout=5)
    finally:
        await c.close()
