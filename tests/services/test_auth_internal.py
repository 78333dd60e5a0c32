"""The authenticated internal plane, on real prefill + decode processes over loopback sockets.

Every internal RPC without the shared secret (or with a wrong one) is UNAUTHENTICATED, health
stays open; a forged or altered ticket is refused before prefill dials anything; Reserve
cannot hold KV past decode's --reserve-ttl-s; only the reserving process can Decode, Release
or Abort a request, and only the process that sent a ticket_follows Prefill can hand it its
ticket; a service without a secret refuses to start."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import InternalAuth, write_secret_file
from common.convert import params_to_pb
from engine.sampling_params import SamplingParams
from protos import (common_pb2, decode_pb2, decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc,
                    prefill_pb2, prefill_pb2_grpc)
from tests import harness
from tests.services.client import Client, take_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SECRET = "s3cret-" + "x" * 40
PROMPT = list(range(3, 3 + 21))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("auth") / "secret")
    write_secret_file(path, SECRET)
    return path


@pytest.fixture(scope="module")
def services(secret_file):
    flags = ["--internal-secret-file", secret_file]  # KV over PushKV (e2e pool / dist: elsewhere)
    with harness.service_pair([*flags, "--kv-transfer-backend", "grpc"],
                              [*flags, "--reserve-ttl-s", "1.5"]) as pair:
        yield pair


def _auth() -> InternalAuth:
    return InternalAuth(secret=SECRET)  # a process of its own: a fresh client id


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _stream_code(call) -> grpc.StatusCode:
    async def read():
        async for _ in call:
            pass
    return await _code(read())


async def test_every_internal_rpc_needs_the_secret(services):
    pre, dec = services
    for creds in (None, InternalAuth(secret="wrong-" + "y" * 30)):
        pc = creds.channel(pre.address) if creds else grpc.aio.insecure_channel(pre.address)
        dc = creds.channel(dec.address) if creds else grpc.aio.insecure_channel(dec.address)
        async with pc, dc:
            d, p = decode_pb2_grpc.DecodeStub(dc), prefill_pb2_grpc.PrefillStub(pc)
            kv = kvtransfer_pb2_grpc.KVTransferStub(dc)
            rel = decode_pb2.ReleaseRequest(request_id="victim")
            calls = {
                "Reserve": d.Reserve(decode_pb2.ReserveRequest(request_id="r", num_prompt_tokens=4)),
                "Release": d.Release(rel), "Abort": d.Abort(rel),
                "Decode.Load": d.Load(common_pb2.LoadRequest()),
                "Prefill": p.Prefill(prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[3])),
                "Prefill.Load": p.Load(common_pb2.LoadRequest()),
                "Ticket": p.Ticket(prefill_pb2.TicketRequest(request_id="r")),
                "PushKV": kv.PushKV(iter(()), timeout=10),  # no message: see PairSession
                "PoolHandoff": kv.PoolHandoff(kvtransfer_pb2.PoolHandoffRequest(transfer_id="t")),
            }
            codes = {k: await _code(c) for k, c in calls.items()}
            codes["Decode"] = await _stream_code(d.Decode(decode_pb2.DecodeRequest(request_id="r")))
            # NOTE: no message sent: the credential check reads the call's metadata, and a
            # message racing the server's rejection makes grpc.aio's client report its own
            # INTERNAL ("Failed execute_batch") about 1 call in 300; the timeout turns a
            # missing check into DEADLINE_EXCEEDED rather than a hang
            codes["PairSession"] = await _stream_code(kv.PairSession(timeout=10))
            assert codes == {k: grpc.StatusCode.UNAUTHENTICATED for k in codes}, codes
            for ch in (pc, dc):  # supervisors and load balancers probe health without credentials
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert h.status == health_pb2.HealthCheckResponse.SERVING
    c = Client(pre.address, dec.address, _auth())
    try:  # with the secret the whole path works (tickets signed, prefill verifies them)
        _, pre_resp, call = await c.start("ok-1", PROMPT, GREEDY)
        assert pre_resp.kv_backend == "grpc" and pre_resp.kv_bytes > 0
        msgs = [m async for m in call]
        assert 1 + sum(len(m.token_ids) for m in msgs) == GREEDY.max_tokens and msgs[-1].finish_reason
    finally:
        await c.close()


class _Trap:
    """A TCP listener that counts who dials it (where a forged ticket points prefill)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def dialed(self) -> bool:
        try:
            self.sock.accept()[0].close()
            return True
        except TimeoutError:
            return False


async def test_forged_tickets_are_refused(services):
    pre, dec = services
    c = Client(pre.address, dec.address, _auth())
    trap = _Trap()
    pp = params_to_pb(GREEDY)
    try:
        async def prefill(rid, ticket):
            return await _code(c.prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=PROMPT, params=pp, ticket=ticket), timeout=20))

        res = await c.decode.Reserve(decode_pb2.ReserveRequest(request_id="forge",
                                                               num_prompt_tokens=len(PROMPT)))
        good = res.ticket
        assert good.signature and good.expires_unix_ms > time.time() * 1e3
        redirected = common_pb2.TransferTicket()
        redirected.CopyFrom(good)
        redirected.decode_address = trap.address  # push our KV to the attacker
        unsigned = common_pb2.TransferTicket()
        unsigned.CopyFrom(redirected)
        unsigned.ClearField("signature")
        more_blocks = common_pb2.TransferTicket()
        more_blocks.CopyFrom(good)
        more_blocks.block_ids.append(63)
        assert await prefill("forge", redirected) == grpc.StatusCode.PERMISSION_DENIED
        assert await prefill("forge", unsigned) == grpc.StatusCode.PERMISSION_DENIED
        assert await prefill("forge", more_blocks) == grpc.StatusCode.PERMISSION_DENIED
        assert await prefill("another-request", good) == grpc.StatusCode.PERMISSION_DENIED
        await asyncio.sleep(0.2)
        assert not trap.dialed(), "prefill dialed the address of a forged ticket"
        assert await prefill("forge", good) == grpc.StatusCode.OK  # the genuine ticket still works
        await c.decode.Release(decode_pb2.ReleaseRequest(request_id="forge"))
    finally:
        trap.sock.close()
        await c.close()


async def test_a_following_ticket_comes_only_from_the_prefills_caller_and_signed(services):
    pre, dec = services
    owner = Client(pre.address, dec.address, _auth())
    other = Client(pre.address, dec.address, _auth())  # same secret, another process
    pp = params_to_pb(GREEDY)
    try:
        t = (await owner.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="follows", num_prompt_tokens=len(PROMPT), prompt_token_ids=PROMPT,
            max_tokens=GREEDY.max_tokens), timeout=10)).ticket
        call = owner.prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="follows", prompt_token_ids=PROMPT, params=pp, ticket_follows=True), timeout=30)
        await asyncio.sleep(0.3)  # the Prefill waits for its ticket

        async def ticket(c, tk):
            return await _code(c.prefill.Ticket(prefill_pb2.TicketRequest(request_id="follows", ticket=tk),
                                                timeout=10))

        assert await ticket(other, t) == grpc.StatusCode.PERMISSION_DENIED  # not its request
        forged = common_pb2.TransferTicket()
        forged.CopyFrom(t)
        forged.block_ids.append(63)
        assert await ticket(owner, forged) == grpc.StatusCode.PERMISSION_DENIED
        assert await ticket(owner, t) == grpc.StatusCode.OK
        resp = await call
        assert resp.kv_backend == "grpc" and resp.kv_bytes > 0  # no pool: from the finished blocks
        msgs = [m async for m in owner.decode.Decode(decode_pb2.DecodeRequest(
            request_id="follows", transfer_id=t.transfer_id, prompt_token_ids=PROMPT,
            first_token_id=resp.first_token_id, params=pp), timeout=60)]
        assert 1 + sum(len(m.token_ids) for m in msgs) == GREEDY.max_tokens
    finally:
        await owner.close()
        await other.close()


async def test_reserve_ttl_is_capped_by_decode(services):
    pre, dec = services
    c = Client(pre.address, dec.address, _auth())
    try:
        free0 = (await c.decode.Load(common_pb2.LoadRequest())).num_free_blocks
        t0 = time.monotonic()
        tickets = [(await c.decode.Reserve(decode_pb2.ReserveRequest(
            request_id=f"hog-{i}", num_prompt_tokens=64, timeout_ms=4294967295))).ticket for i in range(3)]
        assert all(t.expires_ms <= 1500 for t in tickets), [t.expires_ms for t in tickets]
        assert (await c.decode.Load(common_pb2.LoadRequest())).num_free_blocks < free0
        while (await c.decode.Load(common_pb2.LoadRequest())).num_free_blocks < free0:
            assert time.monotonic() - t0 < 10, "reservations held past --reserve-ttl-s"
            await asyncio.sleep(0.1)
    finally:
        await c.close()


async def test_only_the_owner_may_abort_or_release(services):
    pre, dec = services
    owner = Client(pre.address, dec.address, _auth())
    other = Client(pre.address, dec.address, _auth())  # same secret, another process
    try:
        ticket, _, call = await owner.start("owned", PROMPT, LONG)
        assert await take_tokens(call, 2) >= 2
        for rpc in (other.decode.Abort, other.decode.Release):
            for req in (decode_pb2.ReleaseRequest(request_id="owned"),
                        decode_pb2.ReleaseRequest(request_id="owned", transfer_id=ticket.transfer_id)):
                assert await _code(rpc(req)) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(other.decode.Reserve(decode_pb2.ReserveRequest(
            request_id="owned", num_prompt_tokens=4))) != grpc.StatusCode.OK
        assert await take_tokens(call, 5) >= 5  # the stream goes on
        r = await owner.decode.Abort(decode_pb2.ReleaseRequest(request_id="owned"))
        assert r.found
        # a reservation: a stranger can neither release it nor decode from it
        res = await owner.decode.Reserve(decode_pb2.ReserveRequest(request_id="held", num_prompt_tokens=4))
        assert await _code(other.decode.Release(decode_pb2.ReleaseRequest(request_id="held"))) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert await _stream_code(other.decode.Decode(decode_pb2.DecodeRequest(
            request_id="held", transfer_id=res.ticket.transfer_id, prompt_token_ids=[3, 4, 5, 6]))) \
            == grpc.StatusCode.PERMISSION_DENIED
        assert (await owner.decode.Release(decode_pb2.ReleaseRequest(request_id="held"))).found
    finally:
        await owner.close()
        await other.close()


@pytest.mark.parametrize("module", ["decode_svc", "prefill_svc"])
def test_no_secret_no_start(module, tmp_path):
    env = {k: v for k, v in harness.child_env().items()
           if k not in ("SPLITSERVE_INSECURE_INTERNAL", "SPLITSERVE_INTERNAL_SECRET",
                        "SPLITSERVE_INTERNAL_SECRET_FILE")}
    r = subprocess.run([sys.executable, "-m", module, "--port", "0", *harness.TINY_CPU],
                       env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no internal secret" in r.stderr, r.stderr
    loose = tmp_path / "loose"
    loose.write_text(SECRET)
    os.chmod(loose, 0o644)  # readable by others: refused
    r = subprocess.run([sys.executable, "-m", module, "--port", "0", "--internal-secret-file", str(loose),
                        *harness.TINY_CPU], env=env, cwd=harness.ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr
