"""KV transfer faults with real prefill and decode processes (tiny model) and hostile peers on
the test side: each affected request ends with an explicit error within the configured
timeout, its blocks are freed on both sides, and healthy requests beside it complete.

- prefill pushing to a decode that stalls: a socket that accepts and never reads, a PushKV
  that reads everything and never acks, a pool PoolHandoff that never answers
  -> Prefill UNAVAILABLE within --transfer-timeout-s;
- decode receiving from a prefill that stalls after one chunk or sends at a trickle
  -> the reservation fails at --reservation-timeout-s, the waiting Decode call gets
  UNAVAILABLE, the PushKV stream ends with a failed ack (it does not outlive the reservation).
"""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from common.convert import params_to_pb
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc, prefill_pb2
from tests import harness
from tests.services.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TRANSFER_S = 2.0  # prefill --transfer-timeout-s
RESERVE_S = 3.0   # decode --reservation-timeout-s
SLACK_S = 2.0     # reaper pass, RPC and scheduling on a loaded 2-core machine
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(20, 60))


@pytest.fixture(scope="module")
def pair():
    with harness.service_pair(["--transfer-timeout-s", str(TRANSFER_S)],
                              ["--reservation-timeout-s", str(RESERVE_S)]) as p:
        yield p


class _NeverAck(kvtransfer_pb2_grpc.KVTransferServicer):
    """A decode that takes the KV and never answers."""

    async def PushKV(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        await asyncio.Event().wait()

    async def PoolHandoff(self, request, context):
        await asyncio.Event().wait()


async def _load(c: Client):
    return (await c.prefill.Load(common_pb2.LoadRequest(), timeout=5),
            await c.decode.Load(common_pb2.LoadRequest(), timeout=5))


async def _wait_freed(c: Client, free0: int, within_s: float) -> float:
    """Until prefill holds no KV and decode has no reservation and all its blocks free."""
    t0 = time.monotonic()
    while True:
        pl, dl = await _load(c)
        if pl.kv_usage == 0 and dl.reserved == 0 and dl.running == 0 and dl.num_free_blocks == free0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"blocks still held: prefill {pl} decode {dl}"
        await asyncio.sleep(0.1)


async def _healthy(c: Client, n: int) -> list[int]:
    async def one(i):
        toks, _ = await c.generate(f"healthy-{i}-{time.monotonic_ns()}", PROMPT, PARAMS)
        return len(toks)
    return await asyncio.gather(*(one(i) for i in range(n)))


async def _timed(coro) -> tuple[float, grpc.StatusCode, str]:
    t0 = time.monotonic()
    try:
        await coro
        code, details = grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details() or ""
    return time.monotonic() - t0, code, details


async def test_prefill_fails_in_time_when_decode_stalls(pair):
    pre, dec = pair
    c = Client(pre.address, dec.address)
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads
    server = grpc.aio.server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(_NeverAck(), server)
    never_ack = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        free0 = (await _load(c))[1].num_free_blocks
        cases = {"silent socket": (f"127.0.0.1:{silent.getsockname()[1]}", ["grpc"]),
                 "PushKV never acked": (never_ack, ["grpc"]),
                 "PoolHandoff never answered": (never_ack, None)}  # None: the ticket's (shm)

        async def hostile(name, rid):
            addr, backends = cases[name]
            t = (await c.decode.Reserve(decode_pb2.ReserveRequest(
                request_id=rid, num_prompt_tokens=len(PROMPT)), timeout=10)).ticket
            if backends is None:
                assert "shm" in t.kv_backends, f"decode offers no pool backend: {t.kv_backends}"
            else:
                del t.kv_backends[:]
                t.kv_backends.extend(backends)
            t.decode_address = addr  # the real reservation stays behind, never filled
            return await _timed(c.prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=PROMPT, params=params_to_pb(PARAMS), ticket=t),
                timeout=30))

        *bad, good = await asyncio.gather(*(hostile(n, f"stall-{i}") for i, n in enumerate(cases)),
                                          _healthy(c, 3))
        assert good == [PARAMS.max_tokens] * 3
        for name, (took, code, details) in zip(cases, bad):
            assert code == grpc.StatusCode.UNAVAILABLE and "KV transfer to decode failed" in details, \
                (name, code, details)
            assert took < TRANSFER_S + SLACK_S, f"{name}: Prefill answered after {took:.1f} s"
        freed = await _wait_freed(c, free0, RESERVE_S + SLACK_S)
        assert await _healthy(c, 1) == [PARAMS.max_tokens]
        print("prefill errors after", [f"{b[0]:.2f}" for b in bad], f"s; all freed {freed:.2f} s later")
    finally:
        silent.close()
        await server.stop(0)
        await c.close()


def _chunks(ticket, layout, step_bytes: int):
    """The first layer of a transfer, step_bytes per chunk, header on the first."""
    shape = [2, len(ticket.block_ids), ticket.block_size, layout.num_kv_heads, layout.head_dim]
    total = 4 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]  # fp32
    for off in range(0, total, step_bytes):
        ch = kvtransfer_pb2.KVChunk(transfer_id=ticket.transfer_id, layer_index=0, byte_offset=off,
                                    data=bytes(min(step_bytes, total - off)))
        if off == 0:
            ch.layer_nbytes, ch.dtype = total, layout.dtype
            ch.shape.extend(shape)
            ch.num_layers, ch.num_tokens, ch.block_size = layout.num_layers, len(PROMPT), ticket.block_size
        yield ch


async def test_decode_frees_a_stalled_or_trickling_transfer(pair):
    pre, dec = pair
    c = Client(pre.address, dec.address)
    kv = kvtransfer_pb2_grpc.KVTransferStub(c._dc)
    try:
        free0 = (await _load(c))[1].num_free_blocks

        async def stall(t):
            for ch in _chunks(t, t.layout, 1024):
                yield ch
                break
            await asyncio.Event().wait()

        async def trickle(t):
            for ch in _chunks(t, t.layout, 256):
                yield ch
                await asyncio.sleep(0.2)

        async def hostile(rid, sender):
            t = (await c.decode.Reserve(decode_pb2.ReserveRequest(
                request_id=rid, num_prompt_tokens=len(PROMPT)), timeout=10)).ticket
            t0 = time.monotonic()
            push = kv.PushKV(sender(t), timeout=15)  # what the gateway does meanwhile: Decode
            dec_call = c.decode.Decode(decode_pb2.DecodeRequest(
                request_id=rid, transfer_id=t.transfer_id, prompt_token_ids=PROMPT,
                first_token_id=1, params=params_to_pb(PARAMS)), timeout=15)
            decode_res = await _timed(_drain(dec_call))
            ack = await push
            return decode_res, (time.monotonic() - t0, ack)

        *bad, good = await asyncio.gather(hostile("stalled", stall), hostile("trickle", trickle),
                                          _healthy(c, 3))
        assert good == [PARAMS.max_tokens] * 3
        for name, ((took, code, details), (push_s, ack)) in zip(("stalled", "trickle"), bad):
            assert code == grpc.StatusCode.UNAVAILABLE and "timed out" in details, (name, code, details)
            assert took < RESERVE_S + SLACK_S, f"{name}: Decode answered after {took:.1f} s"
            assert not ack.ok and "timed out" in ack.message, (name, ack)
            assert push_s < RESERVE_S + SLACK_S, f"{name}: PushKV held {push_s:.1f} s"
        await _wait_freed(c, free0, SLACK_S)
    finally:
        await c.close()


async def _drain(call) -> None:
    async for _ in call:
        pass
