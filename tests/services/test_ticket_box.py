"""TicketBox (prefill_svc/tickets.py): a ticket reaches its waiting Prefill, or waits for it
(early, for EARLY_TTL_S); only the Prefill's caller may deliver it, once; forgetting a waiter
cancels it; early tickets are bounded and expire."""
from __future__ import annotations

import asyncio

import pytest

from prefill_svc import tickets
from prefill_svc.tickets import TicketBox, TicketRefused


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_delivered_to_the_waiter_once_and_only_by_its_caller():
    box = TicketBox()
    fut = box.expect("r1", "gw-a")
    with pytest.raises(TicketRefused) as e:
        box.deliver("r1", "gw-b", "T")
    assert e.value.code == "PERMISSION_DENIED" and not fut.done()
    box.deliver("r1", "gw-a", "T")
    assert await fut == "T"
    with pytest.raises(TicketRefused) as e:
        box.deliver("r1", "gw-a", "T2")
    assert e.value.code == "ALREADY_EXISTS"
    with pytest.raises(TicketRefused) as e:
        box.expect("r1", "gw-a")  # a second Prefill of a waiting id
    assert e.value.code == "INVALID_ARGUMENT"
    box.forget("r1")
    assert box.num_waiting == 0


async def test_early_ticket_waits_for_its_prefill_and_expires():
    clock = Clock()
    box = TicketBox(clock)
    box.deliver("r1", "gw", "T1")
    with pytest.raises(TicketRefused):
        box.deliver("r1", "gw", "T1b")  # one early ticket per id
    assert (await box.expect("r1", "gw")) == "T1"
    assert box.num_early == 0
    box.deliver("r2", "other", "T2")  # another caller's early ticket is not taken
    f2 = box.expect("r2", "gw")
    assert not f2.done()
    box.forget("r2")
    assert f2.cancelled()
    box.deliver("r3", "gw", "T3")
    clock.t += tickets.EARLY_TTL_S + 1
    f3 = box.expect("r3", "gw")  # expired: not taken
    assert not f3.done()
    box.forget("r3")
    box.deliver("r4", "gw", "T4")
    clock.t += tickets.EARLY_TTL_S + 1
    box.deliver("r5", "gw", "T5")  # a delivery sweeps the expired
    assert box.num_early == 1


async def test_early_tickets_are_bounded(monkeypatch):
    monkeypatch.setattr(tickets, "MAX_EARLY", 3)
    box = TicketBox()
    for i in range(10):
        box.deliver(f"r{i}", "gw", i)
    assert box.num_early == 3
    assert await box.expect("r9", "gw") == 9
    f0 = box.expect("r0", "gw")  # dropped, oldest first
    await asyncio.sleep(0)
    assert not f0.done()
