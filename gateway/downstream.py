"""The downstream half of GatewayCore's path (a mixin): decode.Reserve (a ticket for the KV),
prefill.Prefill (the first token) and the best-effort Release / Abort sent in the background.

Only replicas whose last call or Load poll succeeded are sent work: a dead or frozen replica
is skipped from the moment it is marked down (its next successful poll brings it back), and
when none of a role is up the request is answered at once with UNAVAILABLE + Retry-After
instead of waiting out a deadline on a peer that cannot answer.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import telemetry
from common.convert import params_to_pb as request_params_pb
from gateway.decode_many import DecodeMany
from gateway.routing import POOL_KV_BACKENDS, Route, order_decode, order_prefill
from gateway.types import GatewayError, GenRequest

log = logging.getLogger("splitserve.gateway.core")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
RESERVE_TIMEOUT_S = 10.0
# a replica marked down is polled again within a poll interval: clients may retry after that
DOWN_RETRY_AFTER_S = 2.0


def _down_error(role: str, pool) -> GatewayError:
    why = "; ".join(f"{r.address}: {r.last_error or 'down'}" for r in pool.replicas)
    return GatewayError(grpc.StatusCode.UNAVAILABLE, f"no {role} replica is up ({why})",
                        retry_after_s=DOWN_RETRY_AFTER_S)


class Downstream:
    """Needs (from GatewayCore): prefill, decode (ReplicaPool), predictor, prefix, queue,
    metrics, admission_cfg, prefill_on_decode, decode_streams and the set _bg."""

    def replicas_up(self) -> bool:
        """A decode replica is up, and a prefill one unless every prompt is prefilled on decode."""
        return self.decode.any_healthy() and (self.prefill_on_decode == "always"
                                              or self.prefill.any_healthy())

    def check_replicas_up(self) -> None:
        """UNAVAILABLE + Retry-After at once when a role the request needs has no replica up."""
        if not self.decode.any_healthy():
            raise _down_error("decode", self.decode)
        if self.prefill_on_decode != "always" and not self.prefill.any_healthy():
            raise _down_error("prefill", self.prefill)

    def _background(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _quiet(self, coro, what: str) -> None:
        try:
            await asyncio.wait_for(coro, 5.0)
        except Exception as e:  # noqa: BLE001 - best-effort cleanup
            log.debug("%s failed: %s", what, e)

    def _release(self, replica, request_id: str, transfer_id: str, reason: str,
                 await_kv: bool = False) -> None:
        from protos import decode_pb2

        req = decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id, reason=reason,
                                        await_kv=await_kv)
        self._background(self._quiet(replica.stub.Release(req, timeout=5.0), "Release"))

    def _abort(self, replica, request_id: str, transfer_id: str, reason: str) -> None:
        from protos import decode_pb2

        req = decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id, reason=reason)
        self._background(self._quiet(replica.stub.Abort(req, timeout=5.0), "Abort"))

    def _decode_call(self, replica, request):
        """The request's decode stream: on the replica's DecodeMany call (decode_streams many),
        else its own Decode call. Either reads as a grpc.aio stream call."""
        md = telemetry.inject_metadata()
        if self.decode_streams == "per-request":
            return replica.stub.Decode(request, metadata=md)
        if replica.many is None:
            replica.many = DecodeMany(replica.stub, replica.address)
        return replica.many.open(request, dict(md))

    async def _reserve(self, req: GenRequest):
        """-> (decode replica, ticket). Tries decode replicas in routing order; when all are
        full (RESOURCE_EXHAUSTED) waits and retries until the request's queue budget is spent
        (its TTFT SLO, else max_queue_ms): decode memory is the scarce resource."""
        slo = req.ttft_slo_ms if req.ttft_slo_ms is not None else self.admission_cfg.default_ttft_ms
        budget_ms = min(slo, self.admission_cfg.max_queue_ms) if slo is not None \
            else self.admission_cfg.max_queue_ms
        deadline = req.arrival + budget_ms / 1e3
        backoff = 0.05
        while True:
            r, ticket, last = await self._reserve_once(req)
            if ticket is not None:
                return r, ticket
            if last is None or last.code() != grpc.StatusCode.RESOURCE_EXHAUSTED \
                    or time.monotonic() + backoff > deadline:
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
        if last is None:
            raise _down_error("decode", self.decode)
        code = last.code()
        retry = 1.0 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else (
            DOWN_RETRY_AFTER_S if code == grpc.StatusCode.UNAVAILABLE else None)
        raise GatewayError(code, f"no decode replica could reserve KV for {len(req.prompt_token_ids)}"
                           f" tokens ({', '.join(r.address for r in self.decode.replicas)}): "
                           f"{last.details()}", retry_after_s=retry)

    async def _reserve_once(self, req: GenRequest):
        """-> (replica, ticket, None) or (None, None, last error; None when no replica is up)."""
        from protos import decode_pb2

        last = None
        for r in order_decode(self.decode.replicas, self.predictor):
            if not r.healthy:
                continue
            with telemetry.span("decode.Reserve",
                                attributes={"splitserve.replica": r.address}):
                try:
                    resp = await r.stub.Reserve(decode_pb2.ReserveRequest(
                        request_id=req.request_id, num_prompt_tokens=len(req.prompt_token_ids),
                        prompt_token_ids=req.prompt_token_ids,  # decode skips the blocks it holds
                        max_tokens=req.params.max_tokens), timeout=RESERVE_TIMEOUT_S,
                        metadata=telemetry.inject_metadata())
                    return r, resp.ticket, None
                except grpc.aio.AioRpcError as e:
                    last = e
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        r.mark_down(f"Reserve: {e.code().name}: {e.details()}")
                        continue
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue
                    raise GatewayError(e.code(), f"decode Reserve failed: {e.details()}") from None
                except asyncio.CancelledError:
                    # NOTE: decode may have reserved before the cancel reached it: free by id
                    self._release(r, req.request_id, "", "cancelled during Reserve")
                    raise
        return None, None, last

    def _ticket_follows(self, p) -> bool:
        """Send this prompt before decode's ticket: the pair's last handoff went through a
        shared pool, where prefill needs the ticket only after the first token."""
        if self.reserve_overlap == "off" or not p.pool_peers:
            return False
        d = next((r for r in order_decode(self.decode.replicas, self.predictor) if r.healthy), None)
        return d is not None and d.address in p.pool_peers

    def _note_ticket(self, ticket, route: Route, p, ids) -> None:
        """Decode's block size and the prompt's hashes for the prefix index."""
        if ticket.block_size and ticket.block_size != self.prefix.block_size:
            self.prefix.set_block_size(ticket.block_size)
            route.hashes = None
        if route.hashes is None:
            route.hashes = self.prefix.hashes(ids)
        self.prefix.record(p.address, route.hashes, p.load.num_total_blocks)

    async def _send_ticket(self, p, request_id: str, ticket, call, md) -> None:
        """Prefill.Ticket for a ticket_follows call; a refused ticket ends the call. When the
        call has already failed, its own error is the one raised."""
        from protos import prefill_pb2

        if call.done():
            await call  # it failed before its ticket: its own error
        try:
            await p.stub.Ticket(prefill_pb2.TicketRequest(request_id=request_id, ticket=ticket),
                                timeout=RESERVE_TIMEOUT_S, metadata=md)
        except grpc.aio.AioRpcError:
            if call.done():
                await call  # raises the call's error
            raise

    async def _prefill(self, req: GenRequest, route: Route | None = None):
        """-> (decode replica, ticket, PrefillResponse). Tries the replica admission chose
        first, then the other replicas that are up."""
        from protos import prefill_pb2

        route = route if route is not None else Route()
        params_pb = request_params_pb(req.params)
        tried, last = [], None
        ids = req.prompt_token_ids
        n = len(ids)
        order = order_prefill(self.prefill.replicas, self.predictor, n)
        if route.prefill is not None:
            order = [route.prefill] + [r for r in order if r is not route.prefill]
        for p in order:
            if not p.healthy:
                continue
            follows = self._ticket_follows(p)
            tried.append(p.address)
            held = 0 if p is route.prefill and route.inflight else n
            key = p.add_inflight(held) if held else None
            prefilled = False
            # NOTE: prefill_ms runs from the replica's receipt, its own queue included: only a
            # prompt sent to an otherwise idle replica times the compute the fit models
            route.alone = p.load.inflight_requests == 1 and not p.load.queued_tokens
            dec = ticket = call = None
            try:
                with telemetry.span("prefill.Prefill", attributes={
                        "splitserve.replica": p.address, "splitserve.ticket_follows": follows}):
                    md = telemetry.inject_metadata()
                    if follows:  # the prompt runs while decode reserves (prefill_svc/tickets.py)
                        call = p.stub.Prefill(prefill_pb2.PrefillRequest(
                            request_id=req.request_id, prompt_token_ids=ids, params=params_pb,
                            ticket_follows=True), metadata=md)
                    dec, ticket = await self._reserve(req)
                    self._note_ticket(ticket, route, p, ids)
                    if follows:
                        await self._send_ticket(p, req.request_id, ticket, call, md)
                    else:
                        call = p.stub.Prefill(prefill_pb2.PrefillRequest(
                            request_id=req.request_id, prompt_token_ids=ids, params=params_pb,
                            ticket=ticket), metadata=md)
                    resp = await call
                prefilled = True
                m = self.metrics.routing_prefix_tokens
                m.labels(kind="prompt").inc(n)
                m.labels(kind="predicted").inc(route.cached if p is route.prefill else 0)
                m.labels(kind="cached").inc(resp.num_cached_tokens)
                if resp.kv_backend in POOL_KV_BACKENDS and resp.takes_ticket_follows:
                    p.pool_peers.add(dec.address)
                else:
                    p.pool_peers.discard(dec.address)
                return dec, ticket, resp
            except grpc.aio.AioRpcError as e:
                if call is not None and not call.done():
                    call.cancel()
                if dec is not None:
                    self._release(dec, req.request_id, ticket.transfer_id,
                                  f"prefill failed: {e.code().name}")
                last = e
                if e.code() in _RETRYABLE:
                    p.mark_down(f"Prefill: {e.details()}")
                    p.pool_peers.clear()
                    self.prefix.forget(p.address)
                    continue
                raise GatewayError(e.code(), f"prefill failed: {e.details()}") from None
            except BaseException:
                if call is not None and not call.done():
                    call.cancel()  # NOTE: prefill aborts the prompt and frees its blocks
                if dec is not None:
                    self._release(dec, req.request_id, ticket.transfer_id, "cancelled during prefill")
                raise
            finally:
                if held:
                    p.done_inflight(held, key, prefilled)
                elif p is route.prefill and route.here is None:
                    route.settle(prefilled)
                self.queue.notify()
        if not tried:
            raise _down_error("prefill", self.prefill)
        raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                           f"no prefill replica available (tried {', '.join(tried)}): "
                           f"{last.details() if last is not None else 'none'}",
                           retry_after_s=DOWN_RETRY_AFTER_S)
