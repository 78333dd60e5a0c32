"""SIGTERM to prefill and decode with a stream in flight on decode (real processes, tiny model):
decode's health is NOT_SERVING at once, new work (Reserve, and Load: the gateway's poll then
marks it down) refused with UNAVAILABLE and a retry-after-ms, the stream in flight finishes;
prefill (nothing in flight) and decode exit 0 within the drain timeout."""
from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2
from tests import harness
from tests.services.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

DRAIN_S = 20
ENGINE = ["--port", "0", "--metrics-port", "0", "--model", "dummy:tiny-llama", "--dtype", "fp32",
          "--device", "cpu", "--max-model-len", "2048", "--num-blocks", "300", "--enforce-eager",
          "--drain-timeout-s", str(DRAIN_S)]
N = 1500


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call
    e = ei.value
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.details(), e
    assert dict(e.trailing_metadata() or ()).get("retry-after-ms"), e
    return e


async def test_sigterm_drains_the_stream_in_flight_then_exits():
    pre, dec = harness.spawn("prefill", "prefill_svc", ENGINE), harness.spawn("decode", "decode_svc", ENGINE)
    try:
        harness.wait_all([pre, dec], 120)
        c = Client(pre.address, dec.address)
        try:
            _, first, call = await c.start("r1", [5, 6, 7, 8], SamplingParams(max_tokens=N, ignore_eos=True))
            got = 1
            async for m in call:
                got += len(m.token_ids)
                break
            t0 = time.monotonic()
            pre.popen.send_signal(signal.SIGTERM)
            dec.popen.send_signal(signal.SIGTERM)
            async with grpc.aio.insecure_channel(dec.address) as ch:
                hs = health_pb2_grpc.HealthStub(ch)
                while (await hs.Check(health_pb2.HealthCheckRequest(), timeout=2)).status \
                        != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() - t0 < 2
                    await asyncio.sleep(0.02)
            await _refused(c.decode.Reserve(decode_pb2.ReserveRequest(request_id="r2", num_prompt_tokens=4),
                                            timeout=5))
            await _refused(c.decode.Load(common_pb2.LoadRequest(), timeout=5))
            fin = None
            async for m in call:  # the stream in flight goes on to its end
                got += len(m.token_ids)
                fin = m.finish_reason or fin
            assert got == N and fin is not None
        finally:
            await c.close()
        rcs = [await asyncio.to_thread(p.popen.wait, DRAIN_S + 10) for p in (pre, dec)]
        assert rcs == [0, 0] and time.monotonic() - t0 < DRAIN_S, dec.log()
    finally:
        for p in (pre, dec):
            p.stop(kill=True)
