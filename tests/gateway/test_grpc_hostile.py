"""The public gRPC front against hostile clients: a real gateway process (REST off) in front of
the fake services (decode: 20 ms a token). Huge metadata and oversized messages are refused at
once (RESOURCE_EXHAUSTED) and the next call is served; one connection runs at most
--grpc-max-streams-per-connection calls at once (others on it wait or are refused, never run)
while another connection is served; connections that never finish their HTTP/2 handshake do not
block anyone and are closed by the server after its handshake timeout; a client frozen mid-stream
is dropped (its decode stream cancelled) within ~20 s of keepalive."""
from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from protos import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.harness import ROOT, child_env, gateway_over_fakes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

STREAMS = 4  # --grpc-max-streams-per-connection
HANDSHAKE_S = 10.0  # gateway.server.public_grpc_options: grpc.server_handshake_timeout_ms
MODEL = "dummy-tiny-llama"


@pytest.fixture(scope="module")
def gateway():
    with gateway_over_fakes(["--step-s", "0.02"], [
            "--http-port", "-1", "--max-model-len", "8192",
            "--grpc-max-streams-per-connection", str(STREAMS)]) as (gw, decode):
        yield gw.address, decode


async def _model(address: str, **kw) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await generate_pb2_grpc.GenerationStub(ch).ModelInfo(
            generate_pb2.ModelInfoRequest(), timeout=5, **kw)).model


async def _refused(coro) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await coro
    return ei.value.code(), ei.value.details() or "", time.monotonic() - t0


async def test_huge_metadata_and_messages_are_refused_at_once(gateway):
    address, _ = gateway
    big = [("grpc.max_metadata_size", 4 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=big) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert (await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=5,
                                     metadata=(("x-note", "a" * 8000),))).model == MODEL
        for n in (64 << 10, 1 << 20):
            code, details, took = await _refused(stub.ModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=5, metadata=(("x-junk", "a" * n),)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata" in details, details
            assert took < 2, f"{n}-byte metadata answered after {took:.1f} s"
        code, details, took = await _refused(stub.Generate(generate_pb2.GenerateRequest(
            prompt="x" * (40 << 20), max_tokens=2), timeout=10).read())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, details
        assert took < 2
        assert (await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=5)).model == MODEL


async def _stream(stub, n: int = 20):
    got = 0
    try:
        async for m in stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5, 6]), max_tokens=n, ignore_eos=True), timeout=60):
            got += len(m.token_ids)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return got


async def test_one_connection_runs_at_most_its_stream_limit(gateway):
    address, decode = gateway
    own = [("grpc.use_local_subchannel_pool", 1)]  # NOTE: else the two channels share a connection
    async with grpc.aio.insecure_channel(address, options=own) as ch, \
            grpc.aio.insecure_channel(address, options=own) as other, \
            grpc.aio.insecure_channel(decode) as dch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=5)  # settings exchanged
        load = decode_pb2_grpc.DecodeStub(dch)
        hog = [asyncio.ensure_future(_stream(stub)) for _ in range(4 * STREAMS)]
        polite = asyncio.ensure_future(_stream(generate_pb2_grpc.GenerationStub(other)))
        peak = 0
        while not all(t.done() for t in hog):
            peak = max(peak, (await load.Load(common_pb2.LoadRequest(), timeout=5)).running)
            await asyncio.sleep(0.01)
        outcomes = collections.Counter(t.result() for t in hog)
        assert await polite == 20  # another connection is not held back by the hog's limit
    # NOTE: +1: the other connection's stream may run beside the hog's STREAMS
    assert peak <= STREAMS + 1, f"{peak} streams ran at once on decode"
    assert set(outcomes) <= {20, grpc.StatusCode.UNAVAILABLE} and outcomes[20] >= STREAMS, outcomes
    deadline = time.monotonic() + 5
    while (st := await _load(decode)).running or st.reserved:  # a refused call held nothing
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.05)


async def _load(decode: str):
    async with grpc.aio.insecure_channel(decode) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Load(common_pb2.LoadRequest(), timeout=5)


async def test_silent_connections_block_no_one_and_are_closed(gateway):
    address, _ = gateway
    host, port = address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(100)]
    try:
        t0 = time.monotonic()
        assert await _model(address) == MODEL and time.monotonic() - t0 < 2
        s = silent[0]
        s.settimeout(HANDSHAKE_S + 5)

        def read_to_eof():
            while s.recv(4096):
                pass
            return time.monotonic() - t0

        closed_s = await asyncio.to_thread(read_to_eof)  # the server's SETTINGS, GOAWAY, EOF
        assert HANDSHAKE_S - 1 < closed_s < HANDSHAKE_S + 3, f"closed after {closed_s:.1f} s"
    finally:
        for s in silent:
            s.close()


FROZEN_CLIENT = """
import sys, grpc
from protos import generate_pb2, generate_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]), max_tokens=4000,
                                   ignore_eos=True)
for i, _ in enumerate(generate_pb2_grpc.GenerationStub(ch).Generate(req)):
    if i == 3:
        print("streaming", flush=True)
"""


@pytest.mark.slow
async def test_a_client_frozen_mid_stream_is_dropped(gateway):
    address, decode = gateway
    p = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, address], cwd=ROOT, env=child_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert (await asyncio.to_thread(p.stdout.readline)).strip() == "streaming"
        os.kill(p.pid, signal.SIGSTOP)  # its TCP stays up; it answers no keepalive ping
        t0 = time.monotonic()
        assert (await _load(decode)).running == 1
        while (await _load(decode)).running:
            assert time.monotonic() - t0 < 35, "the frozen client's stream still runs"
            await asyncio.sleep(0.5)
        print(f"frozen client dropped after {time.monotonic() - t0:.1f} s")
    finally:
        p.kill()
        p.wait()
