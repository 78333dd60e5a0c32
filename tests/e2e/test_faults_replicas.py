"""Decode killed with two decode replicas behind one gateway (tiny model, real processes): only
the dead replica's stream ends (UNAVAILABLE within 2 s), the other replica's stream finishes,
and new requests go to the live replica at once."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

# a long context so a stream lasts seconds even on the tiny model
ENGINE = ["--model", "dummy:tiny-llama", "--dtype", "fp32", "--device", "cpu", "--max-model-len",
          "2048", "--num-blocks", "520", "--enforce-eager"]
N = 1800


@pytest.fixture(scope="module")
def stack():
    svc = ["--port", "0", "--metrics-port", "0", *ENGINE]
    procs = [harness.spawn("prefill", "prefill_svc", svc), harness.spawn("decode0", "decode_svc", svc),
             harness.spawn("decode1", "decode_svc", svc)]
    try:
        harness.wait_all(procs, 120)
        gw = harness.spawn("gateway", "gateway", [
            "--port", "0", "--http-port", "-1", "--model", "dummy:tiny-llama", "--max-model-len",
            "2048", "--poll-interval", "0.2", "--prefill", procs[0].address,
            "--decode", procs[1].address, "--decode", procs[2].address])
        gw.wait_ready(120)
    except BaseException:
        for p in procs:
            p.stop(kill=True)
        raise
    yield procs, gw
    for p in [gw, *procs]:
        p.stop(kill=True)


def gen(n: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7, 8]), max_tokens=n, ignore_eos=True,
        sampling=generate_pb2.SamplingParams(temperature=0.0))


async def running(addr: str) -> int:
    async with grpc.aio.insecure_channel(addr) as ch:
        return (await decode_pb2_grpc.DecodeStub(ch).Load(common_pb2.LoadRequest(), timeout=5)).running


async def drain_stream(it) -> tuple[int, str]:
    n, fin = 0, ""
    async for m in it:
        n += len(m.token_ids)
        fin = generate_pb2.FinishReason.Name(m.finish_reason) if m.finish_reason else fin
    return n, fin


async def test_only_the_dead_replicas_stream_ends(stack):
    procs, gw = stack
    decodes = procs[1:]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        calls, first = [], []
        for _ in range(2):  # the second goes where the load poll shows the first is not
            it = stub.Generate(gen(N))
            async for m in it:
                first.append(len(m.token_ids))
                break
            calls.append(it)
            await asyncio.sleep(0.6)
        load = [await running(d.address) for d in decodes]
        assert load == [1, 1], f"streams not spread over the replicas: {load}"
        # which stream runs where: kill decode0, the stream on it ends, the other goes on
        decodes[0].popen.kill()
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(drain_stream(c)) for c in calls]
        done, _ = await asyncio.wait(tasks, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        ended_s = time.monotonic() - t0
        assert len(done) == 1, "no stream ended within 2 s of its replica's death"
        dead = done.pop()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            dead.result()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
        live = next(t for t in tasks if t is not dead)
        n, fin = await asyncio.wait_for(live, 120)
        assert n + first[tasks.index(live)] == N and fin == "FINISH_REASON_LENGTH"
        t0 = time.monotonic()  # new work goes to the live replica at once
        assert await drain_stream(stub.Generate(gen(4))) == (4, "FINISH_REASON_LENGTH")
        assert time.monotonic() - t0 < 5
    print(f"dead replica's stream ended in {ended_s:.2f} s; the other finished")
