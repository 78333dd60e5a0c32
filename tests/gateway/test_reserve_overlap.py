"""The gateway's reserve overlap (--reserve-overlap auto) against fake replicas: prompts go out
with ticket_follows only to a prefill replica that handed this decode replica's KV over through a
pool and says it takes such tickets (an older one never gets them); a Reserve that fails
cancels the running Prefill; a refused Ticket fails the request and frees the reservation."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.admission import AdmissionConfig
from gateway.types import GatewayError
from protos import prefill_pb2
from tests.gateway.conftest import make_core
from tests.gateway.fakes import FakeDecode, FakePrefill, start_server
from tests.gateway.test_core_fakes import collect, req


class PoolPrefill(FakePrefill):
    """Answers as a pool pair; with `takes`, waits for the ticket of a ticket_follows call."""

    def __init__(self, takes: bool, refuse_ticket: bool = False):
        super().__init__()
        self.takes, self.refuse_ticket = takes, refuse_ticket
        self.follows: list[bool] = []
        self.cancelled = 0
        self.tickets: dict[str, asyncio.Future] = {}

    def _fut(self, rid: str) -> asyncio.Future:
        return self.tickets.setdefault(rid, asyncio.get_running_loop().create_future())

    async def Prefill(self, request, context):  # noqa: N802
        self.follows.append(request.ticket_follows)
        try:
            if request.ticket_follows:
                t = await asyncio.wait_for(self._fut(request.request_id), 5)
                assert t.transfer_id
            resp = await super().Prefill(request, context)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        resp.kv_backend, resp.takes_ticket_follows = "shm", self.takes
        return resp

    async def Ticket(self, request, context):  # noqa: N802
        if self.refuse_ticket:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake: bad ticket")
        self._fut(request.request_id).set_result(request.ticket)
        return prefill_pb2.TicketResponse()


async def _stack(prefill: PoolPrefill, admission=None):
    ps, pa = await start_server(prefill)
    dec = FakeDecode()
    ds, da = await start_server(dec)
    core = make_core([pa], [da], admission)
    return core, dec, (ps, ds)


async def _close(core, servers):
    await core.prefill.close()
    await core.decode.close()
    for s in servers:
        await s.stop(None)


@pytest.mark.parametrize("takes", [True, False])
async def test_follows_only_after_a_pool_handoff_to_a_replica_that_takes_it(takes):
    fp = PoolPrefill(takes)
    core, dec, servers = await _stack(fp)
    try:
        for _ in range(3):
            chunks = await collect(core, req(core, "abc", max_tokens=4))
            assert [t for c in chunks for t in c.token_ids] == [100, 101, 102, 103]
        assert fp.follows == ([False, True, True] if takes else [False] * 3)
        await asyncio.sleep(0.1)
        assert not dec.reserved
        core.reserve_overlap = "off"
        await collect(core, req(core, "abc", max_tokens=2))
        assert fp.follows[-1] is False
    finally:
        await _close(core, servers)


async def test_failed_reserve_cancels_the_running_prefill():
    fp = PoolPrefill(True)
    core, dec, servers = await _stack(fp, AdmissionConfig(max_queue_ms=300))
    try:
        await collect(core, req(core, "abc", max_tokens=2))  # proves the pair
        dec.full = True
        with pytest.raises(GatewayError) as e:
            await collect(core, req(core, "abc", max_tokens=2))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fp.follows[-1] is True
        for _ in range(50):
            if fp.cancelled:
                break
            await asyncio.sleep(0.02)
        assert fp.cancelled == 1  # the prompt did not run on for no one
    finally:
        await _close(core, servers)


async def test_refused_ticket_fails_the_request_and_frees_the_reservation():
    fp = PoolPrefill(True)
    core, dec, servers = await _stack(fp)
    try:
        await collect(core, req(core, "abc", max_tokens=2))
        fp.refuse_ticket = True
        with pytest.raises(GatewayError) as e:
            await collect(core, req(core, "abc", max_tokens=2))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "bad ticket" in str(e.value)
        for _ in range(50):
            if fp.cancelled and not dec.reserved:
                break
            await asyncio.sleep(0.02)
        assert fp.cancelled == 1 and not dec.reserved, (fp.cancelled, dec.reserved)
    finally:
        await _close(core, servers)
