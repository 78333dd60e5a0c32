"""Fault matrix on `splitserve up` (SmolLM2 on CPU, prefill and decode split): real processes
killed (-9), frozen (SIGSTOP) and drained (SIGTERM) mid-stream. Each case is one test; they
share one `up` and run in file order, the drain last (it ends `up`).

- a client that leaves before its first token frees its decode reservation within a second;
- decode frozen: /health degraded within 5 s, new requests answered within 1 s (503 +
  Retry-After), the stream in flight resumes after SIGCONT;
- decode killed: its stream ends within 2 s (UNAVAILABLE), the gateway and prefill live on,
  the restarted decode serves within 60 s;
- prefill killed: a stream already decoding finishes; the restarted prefill serves again;
- SIGTERM: health NOT_SERVING, new requests 503 + Retry-After, streams in flight finish,
  `up` exits 0 within the drain timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import httpx
import pytest

from protos import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.harness import UP_PORTS, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DRAIN_S = 20.0
MODEL = ["--model", "default", "--device", "cpu", "--dtype", "fp32", "--num-blocks", "128",
         "--max-model-len", "1024", "--enforce-eager"]


def _up_flags() -> set[str]:
    from splitserve_cli import up

    p = argparse.ArgumentParser()
    up.add_args(p)
    return {o for act in p._actions for o in act.option_strings}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    flags = _up_flags()
    extra = ["--topology", "split"] if "--topology" in flags else []
    secret = None
    if "--internal-secret-file" in flags:  # talk to decode directly (its Load) with the secret
        from common.auth import generate_secret, write_secret_file

        secret = generate_secret()
        path = str(tmp_path_factory.mktemp("secret") / "secret")
        write_secret_file(path, secret)
        extra += ["--internal-secret-file", path]
    with splitserve_up([*UP_PORTS, *extra, "--drain-timeout-s", str(DRAIN_S),
                        "--metrics-ports", "0,0", *MODEL], timeout_s=240) as u:
        u.secret = secret
        yield u


# ---- helpers --------------------------------------------------------------------------------

def pids(u) -> dict[str, int]:
    """name -> pid of up's children now."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(u.popen.pid)], capture_output=True,
                         text=True).stdout.split()
    names = {}
    for pid in map(int, out):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        mod = cmd[2].decode() if len(cmd) > 2 and cmd[1] == b"-m" else ""
        names[{"prefill_svc": "prefill", "decode_svc": "decode"}.get(mod, mod)] = pid
    return names


def address(u, name: str) -> str:
    return re.search(rf"^\s+{name}\s+(\S+:\d+)", u.log(), re.M).group(1)


def gen(n: int, ids=tuple(range(200, 216))) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(ids)), max_tokens=n, ignore_eos=True,
        sampling=generate_pb2.SamplingParams(temperature=0.0))


async def health(u) -> tuple[int, dict]:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(u.rest + "/health")
        return r.status_code, r.json()


async def wait_health(u, code: int, within_s: float) -> float:
    t0 = time.monotonic()
    while (await health(u))[0] != code:
        assert time.monotonic() - t0 < within_s, f"/health not {code} after {within_s} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def decode_reserved(u) -> int:
    md = (("x-splitserve-internal-secret", u.secret),) if u.secret else None
    async with grpc.aio.insecure_channel(address(u, "decode")) as ch:
        st = await decode_pb2_grpc.DecodeStub(ch).Load(common_pb2.LoadRequest(), timeout=5, metadata=md)
        return st.reserved


async def completion(c: httpx.AsyncClient, u, n: int = 4):
    return await c.post(u.rest + "/v1/completions", json={"model": "SmolLM2-135M-Instruct",
                                                          "prompt": "Hello", "max_tokens": n})


async def served_within(u, within_s: float) -> float:
    """Until a request succeeds; -> seconds it took."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        while (await completion(c, u)).status_code != 200:
            assert time.monotonic() - t0 < within_s, f"not served again within {within_s} s:\n" \
                                                     f"{u.log()[-3000:]}"
            await asyncio.sleep(0.5)
    return time.monotonic() - t0


async def stream_tokens(stub, n: int, started: asyncio.Event | None = None) -> tuple[int, str]:
    """-> (tokens received, finish reason name); `started` is set at the first message."""
    toks, fin = 0, ""
    async for m in stub.Generate(gen(n)):
        toks += len(m.token_ids)
        fin = generate_pb2.FinishReason.Name(m.finish_reason) if m.finish_reason else fin
        if started is not None:
            started.set()
    return toks, fin


async def streams_started(stub, k: int, n: int) -> list[asyncio.Future]:
    """k streams of n tokens, each past its first message (decoding) on return."""
    evs = [asyncio.Event() for _ in range(k)]
    calls = [asyncio.ensure_future(stream_tokens(stub, n, e)) for e in evs]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in evs)), 60)
    return calls


# ---- the cases ------------------------------------------------------------------------------

async def test_client_gone_before_first_token_frees_decode_at_once(up):
    pre = pids(up)["prefill"]
    prompt = " ".join(["word"] * 600)  # prefill takes long enough to freeze it mid-way
    async with httpx.AsyncClient(timeout=30) as c:
        req = asyncio.ensure_future(c.post(up.rest + "/v1/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "stream": True}))
        t0 = time.monotonic()
        while await decode_reserved(up) == 0:
            assert time.monotonic() - t0 < 20, "the request never reserved decode KV"
            await asyncio.sleep(0.005)
        os.kill(pre, signal.SIGSTOP)  # the first token cannot come now
        try:
            req.cancel()  # the client hangs up
            t0 = time.monotonic()
            while await decode_reserved(up) and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.05)
            freed_s = time.monotonic() - t0
        finally:
            os.kill(pre, signal.SIGCONT)
    assert freed_s < 1.0, f"decode reservation held {freed_s:.1f} s after the client left"
    await wait_health(up, 200, 10)


async def test_frozen_decode_fails_fast_and_resumes(up):
    dec = pids(up)["decode"]
    async with grpc.aio.insecure_channel(up.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        [call] = await streams_started(stub, 1, 24)
        os.kill(dec, signal.SIGSTOP)
        try:
            degraded_s = await wait_health(up, 503, 5.0)
            async with httpx.AsyncClient(timeout=30) as c:
                for _ in range(3):  # from then on: a clear 503 at once, not a Reserve timeout
                    t0 = time.monotonic()
                    r = await completion(c, up)
                    took = time.monotonic() - t0
                    assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
                    assert took < 1.0 and int(r.headers["retry-after"]) >= 1
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await asyncio.wait_for(stream_tokens(stub, 4), 1.0)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not call.done()
        finally:
            os.kill(dec, signal.SIGCONT)
        got = await asyncio.wait_for(call, 30)  # the stream in flight resumes where it stopped
    assert got == (24, "FINISH_REASON_LENGTH") and degraded_s < 5
    await wait_health(up, 200, 10)


async def test_killed_decode_ends_its_streams_and_comes_back(up):
    before = pids(up)
    async with grpc.aio.insecure_channel(up.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        it = stub.Generate(gen(200))
        async for _ in it:
            break
        os.kill(before["decode"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in it:
                pass
        ended_s = time.monotonic() - t0
    assert ended_s < 2.0 and ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
    back_s = await served_within(up, 60)
    after = pids(up)
    assert after["gateway"] == before["gateway"] and after["prefill"] == before["prefill"]
    assert after["decode"] != before["decode"] and "decode died" in up.log()
    metrics = re.search(r"decode (http://\S+/metrics)", up.log()).group(1)  # same port as before
    text = urllib.request.urlopen(metrics, timeout=5).read().decode()
    assert re.search(r"^splitserve_process_restarts(\{[^}]*\})? 1\.0$", text, re.M), text[:2000]
    print(f"decode killed: stream ended in {ended_s:.2f} s, served again after {back_s:.1f} s")


@pytest.mark.slow
async def test_killed_prefill_lets_decoding_streams_finish(up):
    before = pids(up)
    async with grpc.aio.insecure_channel(up.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = []
        it = stub.Generate(gen(40))
        async for m in it:
            msgs.append(m)
            if len(msgs) == 2:  # decoding: prefill's part is over
                os.kill(before["prefill"], signal.SIGKILL)
        got = (sum(len(m.token_ids) for m in msgs),
               generate_pb2.FinishReason.Name(msgs[-1].finish_reason))
    assert got == (40, "FINISH_REASON_LENGTH")
    await served_within(up, 60)
    assert pids(up)["prefill"] != before["prefill"]


async def test_sigterm_drains_streams_then_exits(up):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(up.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        # NOTE: long enough to outlast the checks below (the gateway exits once they end)
        calls = await streams_started(stub, 2, 32)
        t0 = time.monotonic()
        up.popen.send_signal(signal.SIGTERM)
        hs = health_pb2_grpc.HealthStub(ch)
        while (await hs.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)).status \
                != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - t0 < 2
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=5) as c:
            r = await completion(c, up)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert (await health(up))[1]["status"] == "draining"
        got = await asyncio.gather(*calls)
    assert got == [(32, "FINISH_REASON_LENGTH")] * 2  # every stream in flight finished
    rc = await asyncio.to_thread(up.popen.wait, DRAIN_S + 10)
    assert rc == 0 and time.monotonic() - t0 < DRAIN_S, up.log()[-3000:]
