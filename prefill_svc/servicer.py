"""PrefillServicer: the gRPC edge of the prefill service (thin; the engine thread does the work).

Prefill(request, ticket):
  1. claim the request id in the engine with a layer stream (engine.stream_kv_layers), except
     on a pool backend (vmm / shm), where the KV stays in our shared pool
  2. engine.generate(prefill_only=True): while the prompt's last forward runs, each finished
     layer is handed to the KVPusher, which sends it to ticket.decode_address on the backend
     chosen for this pair (grpc / dist / nixl; prefill_svc/kv_push.py)
  3. first token sampled -> wait for decode's ack of the whole KV (pool backends: one
     PoolHandoff call naming our blocks; decode copies them and answers)
  4. release the blocks (always, also on failure / cancel; full blocks stay in the prefix cache)

Pool backends answer at the first token once the pair has completed one handoff: the handoff
(a device copy on decode, ~1-3 ms with its RPC) then runs after the answer, overlapping the
gateway's first-token write and its Decode call, which waits for the KV (transfer_timeout_ms).
A handoff that fails then fails that transfer on decode, so the request ends with Decode's
error; prefill keeps its blocks, and counts itself in flight (drain), until the handoff ends.
A request that ends at its first token is released with ReleaseRequest.await_kv, so decode
lets such a handoff land and keeps the prompt's blocks cached.

PrefillRequest.ticket_follows: the prompt runs before decode's ticket is there (the gateway
reserves on decode meanwhile and sends it by Ticket; prefill_svc/tickets.py); the ticket is
checked after the first token, then the pool handoff runs as above. A ticket whose route turns
out not to be a pool gets the KV over grpc from the finished blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.auth import caller_id, ticket_refusal
from common.convert import load_to_pb, logprob_to_pb, params_from_pb
from common.runtime import Rate
from common.telemetry import inject_metadata, server_span, set_attrs, span
from engine.sampling_params import InvalidRequestError
from kvtransfer import TransferError
from kvtransfer.endpoint import device_id
from prefill_svc.tickets import TicketBox, TicketRefused, check_ticket_layout, ticket_problem
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("splitserve.prefill")

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine, pusher, metrics, auth=None):
        self.engine = engine          # AsyncEngine (or any object with its interface)
        self.auth = auth              # common.auth.InternalAuth: checks decode's ticket signature
        self.pusher = pusher          # prefill_svc.kv_push.KVPusher
        self.metrics = metrics
        self.layout = pusher.layout
        self.in_flight = 0
        self._rate = Rate()
        self._prompt_tokens = 0
        self._releases: set[asyncio.Future] = set()  # success-path releases still queued
        self.device_id = device_id(pusher.local)     # LoadStats.device_id
        self.tickets = TicketBox()                   # tickets that follow their Prefill

    def _check_ticket(self, t: common_pb2.TransferTicket) -> None:
        check_ticket_layout(t, self.layout)

    def _ticket_problem(self, t: common_pb2.TransferTicket, rid: str, prompt_ids):
        return ticket_problem(t, rid, prompt_ids, self.layout, self.auth)

    async def Ticket(self, request: prefill_pb2.TicketRequest, context):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:  # what needs no prompt is checked here, so the sender hears of it
            self._check_ticket(request.ticket)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        refused = ticket_refusal(self.auth, request.ticket, rid, time.time() * 1e3)
        if refused is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        try:
            self.tickets.deliver(rid, caller_id(context), request.ticket)
        except TicketRefused as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return prefill_pb2.TicketResponse()

    async def _ticket(self, waiter: asyncio.Future, rid: str, context):
        """The ticket of a ticket_follows Prefill, waited for up to the transfer timeout."""
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.pusher.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no ticket for request {rid!r} within {self.pusher.timeout_s:g} s "
                                "of its first token (send it with Ticket)")

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):
        rid = request.request_id
        follows = request.ticket_follows and not request.ticket.transfer_id
        attrs = {"splitserve.request_id": rid, "splitserve.prompt_tokens": len(request.prompt_token_ids),
                 "splitserve.ticket_follows": follows}
        with server_span("prefill", context, attributes=attrs) as sp:
            t_in = time.perf_counter()
            try:
                if not rid:
                    raise InvalidRequestError("request_id is required")
                if not follows:
                    problem = self._ticket_problem(request.ticket, rid, request.prompt_token_ids)
                    if problem is not None:
                        await context.abort(*problem)
                params = params_from_pb(request.params)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            prompt = [int(t) for t in request.prompt_token_ids]
            ticket = None if follows else request.ticket
            skip = ticket.num_cached_blocks if ticket is not None else 0
            route = self.pusher.route(ticket) if ticket is not None else None
            waiter = None
            if follows:
                try:
                    waiter = self.tickets.expect(rid, caller_id(context))
                except TicketRefused as e:
                    await context.abort(getattr(grpc.StatusCode, e.code), str(e))
            loop = asyncio.get_running_loop()
            layers: asyncio.Queue = asyncio.Queue()
            self.in_flight += 1
            ok, added, push = False, False, None  # added: the engine holds the id (free it after)
            detached = False  # the handoff runs on after the answer (_handoff_after frees)
            # the KV stays in our pool (no layers to stream); a following ticket bets on a pool
            pool = follows or self.pusher.is_pool(route)
            t_ticket = None
            try:
                if not pool:
                    try:
                        await self.engine.stream_kv_layers(rid, layers, skip)
                    except InvalidRequestError as e:  # e.g. a duplicate id: nothing of ours is held
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    added = True
                with span("kv.send", attributes={"splitserve.kv.backend":
                                                 route.backend if route else "pending"}) as ksp:
                    if not pool:
                        push = loop.create_task(self.pusher.push(route, ticket, rid, layers, inject_metadata()))
                        push.add_done_callback(_retrieve)  # an early failure is read below (or moot)
                    first = None
                    claimed = added
                    # NOTE: a cancel (client gone) while add_request is queued still lands the
                    # request in the engine: abort it too, or it runs for no one and holds blocks
                    added = True
                    try:
                        async for out in self.engine.generate(rid, prompt, params, prefill_only=True):
                            if out.finish_reason == "error":
                                raise RuntimeError(out.error or "prefill failed in the engine")
                            if out.new_token_ids:
                                first = out
                    except InvalidRequestError as e:  # refused by add_request (e.g. bad token id,
                        added = claimed               # a duplicate id: the other one is not ours)
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    except RuntimeError as e:  # engine error or engine thread died
                        added = True
                        await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
                    if first is None:
                        await context.abort(grpc.StatusCode.INTERNAL, "prefill produced no token")
                    t_first = time.perf_counter()
                    if follows:
                        ticket = await self._ticket(waiter, rid, context)
                        t_ticket = time.perf_counter()
                        self.metrics.kv_ticket_wait.observe(t_ticket - t_first)
                        problem = self._ticket_problem(ticket, rid, prompt)
                        if problem is not None:
                            await context.abort(*problem)
                        skip = ticket.num_cached_blocks
                        route = self.pusher.route(ticket)
                    try:
                        # NOTE: every layer was queued before the first token was delivered; the
                        # bound only guards against a transfer that never ends
                        if not self.pusher.is_pool(route) and follows:  # the bet lost: grpc
                            nbytes, backend = await asyncio.wait_for(
                                self.pusher.send_exported(ticket, rid, self.engine, inject_metadata()),
                                self.pusher.timeout_s + 5)
                        elif pool and self.pusher.proven(route, ticket):
                            nbytes, backend = self._handoff_after(route, ticket, rid, first, len(prompt))
                            detached = True
                        elif pool:
                            nbytes, backend = await self._handoff(route, ticket, rid, first, len(prompt),
                                                                  inject_metadata())
                        else:
                            nbytes, backend = await asyncio.wait_for(push, self.pusher.timeout_s + 5)
                    except (TransferError, asyncio.TimeoutError, TimeoutError) as e:
                        self.metrics.kv_transfer_failures.labels(direction="send").inc()
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            f"KV transfer to decode failed: {str(e) or 'timed out'}")
                    set_attrs(ksp, {"splitserve.kv.backend": backend, "splitserve.kv.bytes": nbytes})
                t_sent = time.perf_counter()
                ok = True
            except BaseException as e:
                # a cancelled RPC (its caller went away or gave up) is an abort, not an error
                cancelled = isinstance(e, asyncio.CancelledError)
                self.metrics.requests.labels(outcome="abort" if cancelled else "error").inc()
                raise
            finally:
                if follows:
                    self.tickets.forget(rid)
                if not detached:
                    self.in_flight -= 1
                if push is not None and not push.done():
                    push.cancel()  # it aborts its transfer
                # NOTE: always, shielded: a cancelled RPC still frees the blocks. abort (not just
                # release) on failure also drops a request whose add_request is still queued.
                if added and not detached:
                    rel = asyncio.ensure_future(_release(self.engine, rid, abort=not ok))
                    if ok:  # the answer need not wait for the engine thread to free the blocks
                        self._releases.add(rel)
                        rel.add_done_callback(self._releases.discard)
                    else:
                        await asyncio.shield(rel)
            if not detached:
                self.metrics.observe_kv_transfer("send", nbytes, t_sent - t_first)
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.request_prompt_tokens.observe(len(prompt))
            if first.queue_s is not None:
                self.metrics.queue_time.observe(first.queue_s)
                self.metrics.prefill_time.observe(first.prefill_s)
            self.metrics.requests.labels(outcome="prefilled").inc()
            self._prompt_tokens += len(prompt)
            tok = first.new_token_ids[0]
            lp = logprob_to_pb(first.logprobs[0], tok) if first.logprobs else None
            n_blocks = -(-len(prompt) // self.layout.block_size) - skip
            set_attrs(sp, {"splitserve.kv.bytes": nbytes, "splitserve.kv.blocks": n_blocks,
                           "splitserve.kv.blocks_held_by_decode": skip,
                           "splitserve.kv.backend": backend,
                           "gen_ai.usage.cache_read.input_tokens": first.num_cached_tokens})
            return prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=tok, first_logprob=lp,
                num_prompt_tokens=first.num_prompt_tokens or len(prompt),
                num_cached_tokens=first.num_cached_tokens, kv_bytes=nbytes, kv_backend=backend,
                takes_ticket_follows=True,
                timings=prefill_pb2.PrefillTimings(
                    prefill_ms=(t_first - t_in) * 1e3, transfer_ms=(t_sent - t_first) * 1e3,
                    ticket_wait_ms=(t_ticket - t_first) * 1e3 if t_ticket is not None else 0.0))

    def _handoff_after(self, route, ticket, rid: str, first, n_prompt: int) -> tuple[int, str]:
        """Start the pool handoff without waiting for it; -> (bytes it will move, backend).
        The task releases the blocks (aborts them on failure) and leaves in_flight after."""
        lay = self.layout
        n_blocks = -(-n_prompt // lay.block_size) - ticket.num_cached_blocks
        task = asyncio.ensure_future(self._handoff_task(route, ticket, rid, first, n_prompt,
                                                        inject_metadata()))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return lay.num_layers * lay.layer_nbytes(n_blocks), route.backend

    def _handoff(self, route, ticket, rid: str, first, n_prompt: int, metadata: tuple):
        """The pool handoff of the request's blocks, bounded (it guards against a transfer
        that never ends); -> awaitable of (bytes, backend)."""
        return asyncio.wait_for(self.pusher.handoff(route, ticket, rid, self.engine, n_prompt,
                                                    metadata, first.block_ids),
                                self.pusher.timeout_s + 5)

    async def _handoff_task(self, route, ticket, rid: str, first, n_prompt: int,
                            metadata: tuple) -> None:
        ok, t0 = False, time.perf_counter()
        try:
            nbytes, _ = await self._handoff(route, ticket, rid, first, n_prompt, metadata)
            ok = True
            self.metrics.observe_kv_transfer("send", nbytes, time.perf_counter() - t0)
        except (TransferError, asyncio.TimeoutError, TimeoutError) as e:
            self.metrics.kv_transfer_failures.labels(direction="send").inc()
            log.warning("KV handoff of %s to %s failed after its first token: %s",
                        rid, ticket.decode_address, str(e) or "timed out")
        except Exception:  # noqa: BLE001 - this request's transfer only
            self.metrics.kv_transfer_failures.labels(direction="send").inc()
            log.exception("KV handoff of %s failed", rid)
        finally:
            self.in_flight -= 1
            await asyncio.shield(_release(self.engine, rid, abort=not ok))

    async def settled(self) -> None:
        """Wait for the handoffs after an answer and the releases still queued (shutdown, tests)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    async def Load(self, request, context):
        st = self.engine.stats()
        return load_to_pb(st, tokens_per_s=int(self._rate.update(self._prompt_tokens)),
                          device_id=self.device_id)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _release(engine, rid: str, abort: bool) -> None:
    try:
        await (engine.abort(rid) if abort else engine.release(rid))
    except Exception:  # noqa: BLE001 - engine gone; nothing left to free
        log.warning("release of %s failed", rid, exc_info=True)
