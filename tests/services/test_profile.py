"""Profiling on demand: a decode service started with --profile-dir records a torch.profiler
trace of its next N engine steps when `splitserve profile` (the Profiler admin RPC) asks, and
writes a Chrome trace that parses as JSON with one range per step; an idle service ends the
profile at the timeout; bad requests, a caller without the internal secret and a service
without --profile-dir get a clear status."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading

import grpc
import pytest

from common.auth import InternalAuth, generate_secret, read_secret_file, write_secret_file
from common.convert import params_to_pb
from common.trace_profile import add_profile_service, call_profile
from engine.sampling_params import SamplingParams
from protos import decode_pb2, decode_pb2_grpc
from splitserve_cli.main import main
from tests import harness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def decode():
    out = tempfile.mkdtemp(prefix="profiles-")
    secret_file = os.path.join(out, "secret")
    write_secret_file(secret_file, generate_secret())
    p = harness.start_service("decode_svc", ["--profile-dir", out, "--internal-secret-file", secret_file])
    p.profile_dir, p.secret_file = out, secret_file
    p.auth = InternalAuth(secret=read_secret_file(secret_file))
    yield p
    p.stop()


async def _generate(decode, n: int) -> int:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async with decode.auth.channel(decode.address) as ch:
        call = decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
            request_id="profiled", prompt_token_ids=list(range(3, 20)), params=params_to_pb(params),
            prefill_here=True), timeout=60)
        return sum([len(m.token_ids) async for m in call])


def test_profile_records_the_next_steps(decode):
    got = {}
    md = decode.auth.metadata()
    t = threading.Thread(target=lambda: got.update(call_profile(decode.address, 3, 60.0, md)))
    t.start()
    n = 0
    while t.is_alive() and n < 200:  # steps only run while a request does
        n += asyncio.run(_generate(decode, 16))
    t.join(60)
    assert got["steps"] == 3 and got["path"].startswith(decode.profile_dir), got
    with open(got["path"]) as f:
        doc = json.load(f)
    steps = {e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("engine.step")}
    assert len(steps) == 3, steps


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`splitserve profile ARGS` in this process -> (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["profile", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_on_an_idle_service_stops_at_the_timeout(decode, capsys):
    rc, out, err = _cli(capsys, "--service", "decode", "--address", decode.address, "--steps", "5",
                        "--timeout", "0.5", "--internal-secret-file", decode.secret_file)
    assert rc == 0, err
    path = out.split()[0]
    assert "(0 steps" in out and os.path.dirname(path) == decode.profile_dir
    with open(path) as f:
        assert isinstance(json.load(f), dict)


def test_bad_requests(decode, capsys):
    with pytest.raises(grpc.RpcError) as ei:
        call_profile(decode.address, 0, 5.0, decode.auth.metadata())
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "steps" in ei.value.details()
    rc, _, err = _cli(capsys, "--steps", "0")
    assert rc == 2 and "--steps" in err
    rc, _, err = _cli(capsys, "--address", decode.address, "--steps", "1", "--timeout", "1")  # no secret
    assert rc == 1 and "UNAUTHENTICATED" in err, err


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
