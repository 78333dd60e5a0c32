"""Decode's transfer tickets on the prefill side: what makes one unusable for a prompt
(`ticket_problem`), and TicketBox, the tickets that follow their Prefill
(PrefillRequest.ticket_follows).

The gateway reserves on decode while the prompt runs, then sends the ticket by the Ticket RPC.
A Prefill waits for its ticket after the first token (`wait`); a Ticket that comes before its
Prefill is registered is kept for EARLY_TTL_S (the two RPCs race on separate HTTP/2 streams).
Only the caller that sent the Prefill may deliver its ticket (common.auth.caller_id).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import grpc

from common.auth import prompt_digest, ticket_refusal
from engine.sampling_params import InvalidRequestError

EARLY_TTL_S = 30.0
MAX_EARLY = 4096  # early tickets kept at most (oldest dropped): a caller cannot grow this


def check_ticket_layout(t, layout) -> None:
    """InvalidRequestError unless the ticket names a transfer and our KV layout."""
    if not t.transfer_id or not t.decode_address:
        raise InvalidRequestError("ticket needs transfer_id and decode_address (call decode.Reserve)")
    lay = t.layout
    theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, t.block_size)
    ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_size)
    if theirs != ours:
        raise InvalidRequestError(
            "decode KV layout (layers, kv_heads, head_dim, dtype, block_size) = "
            f"{theirs} does not match prefill's {ours}: run both with the same model, "
            "--kv-cache-dtype and --block-size")


def ticket_problem(t, rid: str, prompt_ids, layout, auth) -> tuple[grpc.StatusCode, str] | None:
    """Why this ticket cannot carry this prompt's KV (status, message), or None."""
    try:
        check_ticket_layout(t, layout)
        refused = ticket_refusal(auth, t, rid, time.time() * 1e3)
        if refused is not None:  # NOTE: before anything dials ticket.decode_address
            return grpc.StatusCode.PERMISSION_DENIED, refused
        n = len(prompt_ids)
        if t.num_tokens and n != t.num_tokens:
            raise InvalidRequestError(f"prompt has {n} tokens but the decode reservation "
                                      f"is for {t.num_tokens}")
        if t.prompt_digest and prompt_digest(prompt_ids) != t.prompt_digest:
            raise InvalidRequestError("prompt_token_ids differ from the decode "
                                      "reservation's (ticket.prompt_digest)")
        skip = t.num_cached_blocks
        if skip > (n - 1) // layout.block_size:  # NOTE: the last block always goes
            raise InvalidRequestError(f"ticket.num_cached_blocks {skip} exceeds the "
                                      f"{(n - 1) // layout.block_size} full blocks "
                                      f"before a {n}-token prompt's last token")
    except InvalidRequestError as e:
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return None


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
