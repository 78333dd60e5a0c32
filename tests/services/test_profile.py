"""Profiling on demand: a decode service started with --profile-dir records a torch.profiler
trace of its next N engine steps when `splitserve profile` (the Profiler admin RPC) asks, and
writes a Chrome trace that parses as JSON with one range per step; an idle service ends the
profile at the timeout; bad requests and a service without --profile-dir get a clear status."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading

import grpc
import pytest

from common.convert import params_to_pb
from common.trace_profile import add_profile_service, call_profile
from engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def decode():
    out = tempfile.mkdtemp(prefix="profiles-")
    p = harness.start_service("decode_svc", ["--profile-dir", out])
    p.profile_dir = out
    yield p
    p.stop()


async def _generate(address: str, n: int) -> int:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as ch:
        call = decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
            request_id="profiled", prompt_token_ids=list(range(3, 20)), params=params_to_pb(params),
            prefill_here=True), timeout=60)
        return sum([len(m.token_ids) async for m in call])


def test_profile_records_the_next_steps(decode):
    got = {}
    t = threading.Thread(target=lambda: got.update(call_profile(decode.address, 3, 60.0)))
    t.start()
    n = 0
    while t.is_alive() and n < 200:  # steps only run while a request does
        n += asyncio.run(_generate(decode.address, 16))
    t.join(60)
    assert got["steps"] == 3 and got["path"].startswith(decode.profile_dir), got
    with open(got["path"]) as f:
        doc = json.load(f)
    steps = {e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("engine.step")}
    assert len(steps) == 3, steps


def test_cli_on_an_idle_service_stops_at_the_timeout(decode):
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "profile", "--service", "decode",
                        "--address", decode.address, "--steps", "5", "--timeout", "0.5"],
                       capture_output=True, text=True, timeout=60, cwd=harness.ROOT,
                       env=harness.child_env())
    assert r.returncode == 0, r.stderr
    path = r.stdout.split()[0]
    assert "(0 steps" in r.stdout and os.path.dirname(path) == decode.profile_dir
    with open(path) as f:
        assert isinstance(json.load(f), dict)


def test_bad_requests(decode):
    with pytest.raises(grpc.RpcError) as ei:
        call_profile(decode.address, 0, 5.0)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "steps" in ei.value.details()
    r = subprocess.run([sys.executable, "-m", "splitserve_cli", "profile", "--steps", "0"],
                       capture_output=True, text=True, timeout=60, cwd=harness.ROOT,
                       env=harness.child_env())
    assert r.returncode == 2 and "--steps" in r.stderr


async def test_without_profile_dir_is_failed_precondition():
    server = grpc.aio.server()
    add_profile_service(server, engine=None, service="prefill", profile_dir=None)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with pytest.raises(grpc.RpcError) as ei:
            await asyncio.to_thread(call_profile, f"127.0.0.1:{port}", 2, 5.0)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--profile-dir" in ei.value.details()
    finally:
        await server.stop(None)
