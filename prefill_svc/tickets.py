"""TicketBox: decode tickets that follow their Prefill (PrefillRequest.ticket_follows).

The gateway reserves on decode while the prompt runs, then sends the ticket by the Ticket RPC.
A Prefill waits for its ticket after the first token (`wait`); a Ticket that comes before its
Prefill is registered is kept for EARLY_TTL_S (the two RPCs race on separate HTTP/2 streams).
Only the caller that sent the Prefill may deliver its ticket (common.auth.caller_id).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

EARLY_TTL_S = 30.0
MAX_EARLY = 4096  # early tickets kept at most (oldest dropped): a caller cannot grow this


class TicketRefused(Exception):
    """A Ticket the box will not take; `code` names the gRPC status."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class TicketBox:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._waiting: dict[str, tuple[str, asyncio.Future]] = {}  # rid -> (caller, future)
        self._early: OrderedDict[str, tuple[str, float, object]] = OrderedDict()

    def expect(self, rid: str, caller: str) -> asyncio.Future:
        """Register a Prefill waiting for its ticket -> a future of the ticket."""
        if rid in self._waiting:
            raise TicketRefused("INVALID_ARGUMENT", f"request {rid!r} already waits for a ticket")
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (caller, fut)
        early = self._early.pop(rid, None)
        if early is not None and early[0] == caller and self._clock() - early[1] <= EARLY_TTL_S:
            fut.set_result(early[2])
        return fut

    def deliver(self, rid: str, caller: str, ticket) -> None:
        """Hand a ticket to its waiting Prefill, or keep it until the Prefill registers."""
        w = self._waiting.get(rid)
        if w is None:
            self._expire()
            if rid in self._early:
                raise TicketRefused("ALREADY_EXISTS", f"request {rid!r} already has a ticket")
            self._early[rid] = (caller, self._clock(), ticket)
            while len(self._early) > MAX_EARLY:
                self._early.popitem(last=False)
            return
        owner, fut = w
        if owner != caller:
            raise TicketRefused("PERMISSION_DENIED", f"request {rid!r} belongs to another caller")
        if fut.done():
            raise TicketRefused("ALREADY_EXISTS", f"request {rid!r} already has a ticket")
        fut.set_result(ticket)

    def forget(self, rid: str) -> None:
        """The Prefill ended (answered, failed or cancelled)."""
        w = self._waiting.pop(rid, None)
        if w is not None and not w[1].done():
            w[1].cancel()

    def _expire(self) -> None:
        now = self._clock()
        while self._early:
            rid, (_, t, _) = next(iter(self._early.items()))
            if now - t <= EARLY_TTL_S:
                break
            self._early.popitem(last=False)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_early(self) -> int:
        return len(self._early)
