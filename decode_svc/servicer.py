"""DecodeServicer: the gRPC edge of the decode service.

Lifecycle of one request:
  reserved   Reserve: engine.reserve pre-allocates blocks, KVReceiver.expect(transfer id); given
             the prompt, its leading full blocks found in our prefix cache are pinned instead
             and named in ticket.num_cached_blocks: prefill sends only the blocks after them
  receiving  KV lands layer by layer in those blocks: KVTransfer.PushKV (grpc backend) or the
             pair's KVTransfer.PairSession (dist / nixl; tickets say which backends we accept)
  running    Decode: waits for the transfer DONE, claims it, engine.add_prefilled joins the batch
  finished   stop / length / stop string / abort; blocks freed by the engine
A reservation whose KV or Decode call never comes is failed by the receiver's reaper at its
deadline and its blocks released; a cancelled Decode stream aborts the request (blocks freed).

Trust: the caller never sets how long blocks stay held (Reserve's timeout_ms is capped at
max_reservation_s); tickets are signed (common.auth.sign_ticket); a request belongs to the
caller process that reserved it (common.auth.caller_id): Decode, Release and Abort from
another caller are PERMISSION_DENIED.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import grpc

from common.auth import InternalAuth, caller_id, prompt_digest, sign_ticket
from common.convert import load_to_pb, params_from_pb
from common.runtime import Rate
from common.telemetry import server_span, set_attrs
from engine.sampling_params import InvalidRequestError
from decode_svc.many import ManyMixin
from decode_svc.streaming import _ABORTED, StreamingMixin, _Abort, _abort_quietly
from kvtransfer import KVReceiver, TransferError, TransferState
from protos import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("splitserve.decode")

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
RELEASE_WAIT_S = 3.0  # Release(await_kv): the longest wait for a transfer's KV to land


class DecodeServicer(ManyMixin, StreamingMixin, decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine, receiver: KVReceiver, metrics, *, address: str = "",
                 reservation_timeout_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 owner: dict[str, str] | None = None, kv_backends=("grpc",), pair=None,
                 auth: InternalAuth | None = None, max_reservation_s: float = 60.0):
        self.engine = engine              # AsyncEngine
        self.receiver = receiver
        self.metrics = metrics
        self.address = address            # host:port written into tickets (set once bound)
        self.max_reservation_s = max_reservation_s  # cap of a caller's Reserve.timeout_ms
        self.reservation_timeout_s = min(reservation_timeout_s, max_reservation_s)
        self.auth = auth                  # signs tickets (None: unsigned, insecure plane)
        self._callers: dict[str, str] = {}  # request id -> caller_id of the process that owns it
        self.transfer_timeout_s = transfer_timeout_s
        self._reserved_tokens: dict[str, int] = {}  # transfer id -> prompt tokens
        self._running: dict[str, tuple] = {}  # request id -> (its stream task, engine stream)
        self._tpot_budgets: dict[str, tuple] = {}  # request id -> (engine stream, tpot_ms)
        # request id -> transfer id of its current (unclaimed) reservation; read by the sink
        self.owner: dict[str, str] = owner if owner is not None else {}
        self.kv_backends = list(kv_backends)  # advertised in tickets, preferred first
        self.pair = pair                      # kvtransfer.endpoint.PairEndpoint for dist / nixl
        self.device_id = ""                   # LoadStats.device_id (set by the service's main)
        self._rate = Rate()
        self._generated = 0

    # ---- Reserve ----------------------------------------------------------------------
    async def Reserve(self, request: decode_pb2.ReserveRequest, context):
        rid, n = request.request_id, request.num_prompt_tokens
        prompt = [int(x) for x in request.prompt_token_ids] or None
        with server_span("decode.reserve", context, attributes={"splitserve.request_id": rid}):
            if not rid:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
            if prompt is not None and len(prompt) != n:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt_token_ids has {len(prompt)} tokens, "
                                    f"num_prompt_tokens says {n}")
            if rid in self._running:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request id {rid!r} is already decoding")
            await self._check_caller(rid, context)
            # A Reserve for an id that holds an unclaimed reservation is a retry (e.g. the
            # gateway moved to another prefill replica): the new one replaces the old.
            # NOTE: ownership moves to the new transfer id *before* anything is queued on the
            # engine, so a late release of the old transfer is skipped (EngineKVSink checks
            # `owner`), and the stale blocks are freed here, in order before the new reserve.
            old = self.receiver.find_request(rid)
            if old is not None:
                self.receiver.fail(old.transfer_id, "replaced by a new Reserve", release=False)
                self._reserved_tokens.pop(old.transfer_id, None)
            tid = uuid.uuid4().hex
            self.owner[rid] = tid
            self._callers[rid] = caller_id(context)
            try:  # frees what a failed / replaced earlier reservation of the id still holds
                blocks = await self.engine.reserve_replacing(rid, n, prompt)
            except (InvalidRequestError, ValueError) as e:
                self._disown(rid, tid)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if blocks is None:
                self._disown(rid, tid)
                st = self.engine.stats()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no room for {n} prompt tokens: {st.get('num_free_blocks')} of "
                                    f"{st.get('num_blocks')} KV blocks free")
            # NOTE: the caller may shorten the hold, never extend it past our cap
            timeout = min(request.timeout_ms / 1e3 if request.timeout_ms else self.reservation_timeout_s,
                          self.max_reservation_s)
            lay = self.receiver.layout
            held = -(-n // lay.block_size) - len(blocks)  # leading blocks our prefix cache holds
            t = self.receiver.expect(tid, rid, len(blocks), n, timeout, block_ids=blocks,
                                     skip_blocks=held)
            t.prompt = tuple(prompt) if prompt is not None else ()
            self._reserved_tokens[tid] = n
            ticket = common_pb2.TransferTicket(
                transfer_id=tid, decode_address=self.address, block_ids=blocks,
                block_size=lay.block_size, num_tokens=n, expires_ms=int(timeout * 1e3),
                expires_unix_ms=int((time.time() + timeout) * 1e3),
                layout=common_pb2.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                                           head_dim=lay.head_dim, dtype=lay.dtype),
                kv_backends=self.kv_backends, num_cached_blocks=held,
                prompt_digest=prompt_digest(prompt) if prompt is not None else b"")
            if self.pair is not None:
                ticket.pair.CopyFrom(self.pair.to_pb())
            sign_ticket(self.auth, ticket, rid)
            return decode_pb2.ReserveResponse(ticket=ticket)

    async def _check_caller(self, rid: str, context) -> None:
        """PERMISSION_DENIED unless rid is free or held by this caller's process."""
        held = self._callers.get(rid)
        if held is not None and held != caller_id(context) and self._holds(rid):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"request {rid!r} belongs to another client")

    def _holds(self, rid: str) -> bool:
        return rid in self._running or self.receiver.find_request(rid) is not None

    def _disown(self, rid: str, tid: str) -> None:
        if self.owner.get(rid) == tid:
            self.owner.pop(rid, None)

    # ---- Decode -----------------------------------------------------------------------
    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        if request.prefill_here:
            async for resp in self._decode_here(request, context):
                yield resp
            return
        rid, tid = request.request_id, request.transfer_id
        with server_span("decode", context, attributes={"splitserve.request_id": rid}) as sp:
            t = self.receiver.get(tid)
            if t is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"unknown transfer {tid!r} (never reserved, or expired)")
            if t.request_id != rid:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"transfer {tid!r} belongs to request {t.request_id!r}, not {rid!r}")
            await self._check_caller(rid, context)
            try:
                params = params_from_pb(request.params)
                want = self._reserved_tokens.get(tid)
                if want is not None and len(request.prompt_token_ids) != want:
                    raise InvalidRequestError(f"prompt has {len(request.prompt_token_ids)} tokens "
                                              f"but transfer {tid} reserved {want}")
                if t.prompt and tuple(request.prompt_token_ids) != t.prompt:
                    # NOTE: the KV (held blocks and sent ones) is Reserve's prompt's, and the
                    # prefix cache files it under these tokens: another prompt would poison it
                    raise InvalidRequestError("prompt_token_ids differ from the Reserve's")
            except InvalidRequestError as e:
                self.receiver.fail(tid, f"bad Decode request: {e}")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            t0 = time.perf_counter()
            wait_s = request.transfer_timeout_ms / 1e3 if request.transfer_timeout_ms else self.transfer_timeout_s
            try:
                await self.receiver.wait(tid, wait_s)
                transfer = self.receiver.claim(tid)  # from here the engine request owns the blocks
            except KeyError as e:  # a second Decode for one transfer, or it expired meanwhile
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e).strip("'\""))
            except TransferError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except (asyncio.TimeoutError, TimeoutError):
                self.receiver.fail(tid, "Decode gave up waiting for the KV")
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"KV for transfer {tid} did not arrive within {wait_s:.1f}s")
            except asyncio.CancelledError:
                self.receiver.fail(tid, "Decode cancelled while waiting for the KV")
                raise
            self._reserved_tokens.pop(tid, None)
            self._disown(rid, tid)
            wait_ms = (time.perf_counter() - t0) * 1e3
            self.metrics.observe_kv_transfer("recv", transfer.bytes_moved, transfer.transfer_s)
            if transfer.skip_blocks:
                lay = self.receiver.layout
                self.metrics.kv_prefix_reused_blocks.inc(transfer.skip_blocks)
                self.metrics.kv_prefix_reused_bytes.inc(
                    transfer.skip_blocks * lay.num_layers * lay.layer_nbytes(1))
            set_attrs(sp, {"splitserve.kv.bytes": transfer.bytes_moved, "splitserve.kv.wait_ms": wait_ms,
                           "splitserve.kv.blocks_held": transfer.skip_blocks})
            try:
                # NOTE: aclosing: a cancel that lands while we sit at `yield` still closes it
                async with contextlib.aclosing(self._responses(rid, request, params, wait_ms, context)) as st:
                    async for resp in st:
                        yield resp
            except _Abort as e:
                await context.abort(e.code, str(e))
            except RuntimeError as e:  # engine error / engine thread died
                await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {e}")

    async def _decode_here(self, request: decode_pb2.DecodeRequest, context):
        """Decode with prefill_here: the prompt runs in this engine (no reservation, no KV)."""
        rid = request.request_id
        with server_span("decode", context, attributes={"splitserve.request_id": rid,
                                                        "splitserve.prefill_here": True}):
            try:
                if not rid:
                    raise InvalidRequestError("request_id is required")
                if self._holds(rid):
                    raise InvalidRequestError(f"request id {rid!r} is already in use here")
                if not request.prompt_token_ids:
                    raise InvalidRequestError("prompt_token_ids is empty")
                params = params_from_pb(request.params)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
            self._callers[rid] = caller_id(context)
            self.metrics.request_prompt_tokens.observe(len(request.prompt_token_ids))
            try:
                async with contextlib.aclosing(self._responses(rid, request, params, 0.0, context,
                                                               here=True)) as st:
                    async for resp in st:
                        yield resp
            except _Abort as e:
                await context.abort(e.code, str(e))
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {e}")

    # ---- Release / Abort / Load -------------------------------------------------------
    async def Release(self, request: decode_pb2.ReleaseRequest, context):
        return decode_pb2.ReleaseResponse(found=await self._drop(request, "released", context))

    async def Abort(self, request: decode_pb2.ReleaseRequest, context):
        return decode_pb2.ReleaseResponse(found=await self._drop(request, "aborted", context))

    async def _drop(self, request, why: str, context) -> bool:
        rid, tid = request.request_id, request.transfer_id
        t = self.receiver.get(tid) if tid else self.receiver.find_request(rid)
        await self._check_caller(t.request_id if t is not None else rid, context)
        if request.await_kv and t is not None and not t.claimed and not t.state.terminal:
            # ended at its first token: its KV may still be landing (prefill answers before a
            # proven pool handoff ends); let it, so its prompt's blocks are published
            with contextlib.suppress(Exception):
                await self.receiver.wait(t.transfer_id, RELEASE_WAIT_S)
        if t is not None and t.state is TransferState.DONE and t.prompt and not t.claimed:
            # its KV arrived whole (the first token ended the request): keep its prompt's
            # full blocks for later reservations; the release below runs after (FIFO)
            await self.engine.publish_if_owner(t.request_id, t.transfer_id, self.owner, list(t.prompt))
        if t is not None and not t.claimed and self.receiver.fail(
                t.transfer_id, f"{why} by the caller{': ' + request.reason if request.reason else ''}"):
            self._reserved_tokens.pop(t.transfer_id, None)
            return True
        running = self._running.pop(rid, None)
        if running is not None:
            # the Decode stream ends with FINISH_REASON_ABORT (unless it just ended by itself)
            # and closing its engine stream aborts the engine request
            self.engine.interrupt(rid, _ABORTED)
            await _abort_quietly(self.engine, rid)
            return True
        return False

    async def Load(self, request, context):
        pending = {t.transfer_id for t in self.receiver.pending()}
        for tid in [k for k in self._reserved_tokens if k not in pending]:
            self._reserved_tokens.pop(tid, None)  # expired / failed reservations
        for rid in [r for r in self._callers if not self._holds(r)]:
            self._callers.pop(rid, None)  # their requests ended or expired
        return load_to_pb(self.engine.stats(), reserved=len(pending), device_id=self.device_id,
                          queued_tokens=sum(self._reserved_tokens.values()),
                          tokens_per_s=int(self._rate.update(self._generated)),
                          min_tpot_ms=min((b for _, b in self._tpot_budgets.values()), default=0.0))
