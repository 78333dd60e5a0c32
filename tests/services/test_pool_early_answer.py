"""Prefill answers at the first token once its decode has taken a pool handoff: the handoff then
runs after the answer (real prefill and decode processes, shm pool, tiny model). A relay
between them delays or fails PoolHandoff: a delayed handoff does not delay Prefill's answer and
the output stays exact; a failed one ends the request with Decode's explicit error and frees
the blocks on both sides."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.convert import params_to_pb
from common.grpc_util import channel_options, open_channel
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, kvtransfer_pb2_grpc, prefill_pb2
from tests import harness
from tests.services.client import Client
from tests.services.test_disagg_e2e import _colocated

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

RESERVE_S = 3.0
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(30 + 7 * i, 70 + 7 * i)) for i in range(3)]


class _Relay(kvtransfer_pb2_grpc.KVTransferServicer):
    """Forwards PoolHandoff to the real decode after `delay_s`, or fails it (`fail`)."""

    def __init__(self, decode_address: str):
        self._ch = open_channel(decode_address, None, channel_options())
        self._stub = kvtransfer_pb2_grpc.KVTransferStub(self._ch)
        self.delay_s, self.fail, self.calls = 0.0, False, 0

    async def PoolHandoff(self, request, context):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "relay: dropped")
        return await self._stub.PoolHandoff(request, timeout=10)


@pytest.fixture(scope="module")
def pair():
    with harness.service_pair([], ["--reservation-timeout-s", str(RESERVE_S)]) as p:
        yield p


async def _start(c: Client, relay_addr: str, rid: str, prompt):
    pp = params_to_pb(PARAMS)
    t = (await c.decode.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
        max_tokens=PARAMS.max_tokens), timeout=10)).ticket
    assert "shm" in t.kv_backends, t.kv_backends
    tid = t.transfer_id
    t.decode_address = relay_addr  # prefill's handoff goes through the relay
    t0 = time.monotonic()
    pre = await c.prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=pp, ticket=t), timeout=30)
    took = time.monotonic() - t0
    call = c.decode.Decode(decode_pb2.DecodeRequest(
        request_id=rid, transfer_id=tid, prompt_token_ids=prompt,
        first_token_id=pre.first_token_id, params=pp), timeout=60)
    return pre, took, call


async def _tokens(pre, call) -> list[int]:
    toks = [pre.first_token_id]
    async for m in call:
        toks += list(m.token_ids)
    return toks


async def _freed(c: Client, free0: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        pl = await c.prefill.Load(common_pb2.LoadRequest(), timeout=5)
        dl = await c.decode.Load(common_pb2.LoadRequest(), timeout=5)
        if pl.kv_usage == 0 and dl.reserved == 0 and dl.running == 0 and dl.num_free_blocks == free0:
            return
        assert time.monotonic() < deadline, f"blocks still held: prefill {pl} decode {dl}"
        await asyncio.sleep(0.1)


async def test_answer_before_handoff_then_late_failure_is_explicit(pair):
    pre_p, dec_p = pair
    want = _colocated(PROMPTS, PARAMS)
    relay = _Relay(dec_p.address)
    server = grpc.aio.server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(relay, server)
    relay_addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    c = Client(pre_p.address, dec_p.address)
    try:
        free0 = (await c.decode.Load(common_pb2.LoadRequest(), timeout=5)).num_free_blocks
        # first handoff to this decode: Prefill waits for it (the pair is not proven yet)
        relay.delay_s = 1.0
        pre, took, call = await _start(c, relay_addr, "early-0", PROMPTS[0])
        assert took >= 1.0, f"the first handoff was not awaited ({took:.2f} s)"
        assert await _tokens(pre, call) == want[0]
        # proven: the answer comes before the (delayed) handoff, Decode waits for the KV
        relay.delay_s = 2.0
        pre, took, call = await _start(c, relay_addr, "early-1", PROMPTS[1])
        assert took < 1.5, f"Prefill waited for the handoff ({took:.2f} s)"
        assert pre.kv_backend == "shm" and pre.timings.transfer_ms < 500, pre
        assert await _tokens(pre, call) == want[1]
        # a handoff that fails after the answer: Decode ends with an error, blocks are freed
        relay.delay_s, relay.fail = 0.0, True
        pre, took, call = await _start(c, relay_addr, "early-2", PROMPTS[2])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _tokens(pre, call)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e.value
        await _freed(c, free0, RESERVE_S + 5)
        assert relay.calls == 3
        # the failure un-proves the pair: the next handoff is awaited again, and succeeds
        relay.fail, relay.delay_s = False, 1.0
        pre, took, call = await _start(c, relay_addr, "early-3", PROMPTS[0])
        assert took >= 1.0 and await _tokens(pre, call) == want[0]
        await _freed(c, free0, 5)
    finally:
        await c.close()
        await server.stop(0)
