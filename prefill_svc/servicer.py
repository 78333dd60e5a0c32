"""PrefillServicer: the gRPC edge of the prefill service (thin; the engine thread does the work).

Prefill(request, ticket):
  1. engine.generate(prefill_only=True) -> first token (+ logprobs); the engine keeps the blocks
  2. export_kv -> push every layer to ticket.decode_address (kvtransfer gRPC backend)
  3. release the blocks (always, also on failure / cancel; full blocks stay in the prefix cache)
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.convert import load_to_pb, logprob_to_pb, params_from_pb
from common.runtime import Rate, server_span, set_span_attrs, span, trace_metadata
from engine.sampling_params import InvalidRequestError
from kvtransfer import KVLayout, TransferError, send_blocks
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("splitserve.prefill")

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine, sender, metrics, transfer_timeout_s: float = 30.0):
        self.engine = engine          # AsyncEngine (or any object with its interface)
        self.sender = sender          # kvtransfer.KVSender
        self.metrics = metrics
        self.transfer_timeout_s = transfer_timeout_s
        info = engine.info()
        self.layout = KVLayout(num_layers=info["num_layers"], num_kv_heads=info["num_kv_heads"],
                               head_dim=info["head_dim"], dtype=info["kv_dtype"],
                               block_size=info["block_size"])
        self.in_flight = 0
        self._rate = Rate()
        self._prompt_tokens = 0

    def _check_ticket(self, t: common_pb2.TransferTicket) -> None:
        if not t.transfer_id or not t.decode_address:
            raise InvalidRequestError("ticket needs transfer_id and decode_address (call decode.Reserve)")
        lay = t.layout
        theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, t.block_size)
        ours = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim,
                self.layout.dtype, self.layout.block_size)
        if theirs != ours:
            raise InvalidRequestError(
                "decode KV layout (layers, kv_heads, head_dim, dtype, block_size) = "
                f"{theirs} does not match prefill's {ours}: run both with the same model, "
                "--kv-cache-dtype and --block-size")

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):
        rid = request.request_id
        with server_span("prefill", context, {"splitserve.request_id": rid,
                                              "splitserve.prompt_tokens": len(request.prompt_token_ids)}) as sp:
            t_in = time.perf_counter()
            try:
                if not rid:
                    raise InvalidRequestError("request_id is required")
                self._check_ticket(request.ticket)
                n = len(request.prompt_token_ids)
                if request.ticket.num_tokens and n != request.ticket.num_tokens:
                    raise InvalidRequestError(f"prompt has {n} tokens but the decode reservation "
                                              f"is for {request.ticket.num_tokens}")
                params = params_from_pb(request.params)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            prompt = [int(t) for t in request.prompt_token_ids]
            ticket = request.ticket
            self.in_flight += 1
            ok, added = False, True  # added: the engine may hold the request (free it after)
            try:
                first = None
                try:
                    async for out in self.engine.generate(rid, prompt, params, prefill_only=True):
                        if out.finish_reason == "error":
                            raise RuntimeError(out.error or "prefill failed in the engine")
                        if out.new_token_ids:
                            first = out
                except InvalidRequestError as e:  # refused by add_request: nothing held
                    added = False  # NOTE: e.g. a duplicate id; freeing "rid" would hit the other one
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except RuntimeError as e:  # engine error or engine thread died
                    await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
                if first is None:
                    await context.abort(grpc.StatusCode.INTERNAL, "prefill produced no token")
                t_first = time.perf_counter()
                kv = await self.engine.call(lambda e: e.export_kv(rid))
                try:
                    with span("kv.send", {"splitserve.kv.backend": "grpc",
                                          "splitserve.kv.blocks": kv.num_blocks}):
                        nbytes = await send_blocks(self.sender, ticket.decode_address, ticket.transfer_id,
                                                   rid, kv, self.layout, self.transfer_timeout_s,
                                                   trace_metadata())
                except TransferError as e:
                    self.metrics.kv_transfer_failures.labels(direction="send").inc()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to decode failed: {e}")
                t_sent = time.perf_counter()
                ok = True
            except BaseException:
                self.metrics.requests.labels(outcome="error").inc()
                raise
            finally:
                self.in_flight -= 1
                # NOTE: always, shielded: a cancelled RPC still frees the blocks. abort (not just
                # release) on failure also drops a request whose add_request is still queued.
                if added:
                    await asyncio.shield(_release(self.engine, rid, abort=not ok))
            self.metrics.observe_kv_transfer("send", nbytes, t_sent - t_first)
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.requests.labels(outcome="prefilled").inc()
            self._prompt_tokens += len(prompt)
            tok = first.new_token_ids[0]
            lp = logprob_to_pb(first.logprobs[0], tok) if first.logprobs else None
            set_span_attrs(sp, {"splitserve.kv.bytes": nbytes, "splitserve.kv.blocks": kv.num_blocks,
                                "gen_ai.usage.cached_tokens": first.num_cached_tokens})
            return prefill_pb2.PrefillResponse(
                request_id=rid, first_token_id=tok, first_logprob=lp,
                num_prompt_tokens=first.num_prompt_tokens or len(prompt),
                num_cached_tokens=first.num_cached_tokens, kv_bytes=nbytes,
                timings=prefill_pb2.PrefillTimings(prefill_ms=(t_first - t_in) * 1e3,
                                                   transfer_ms=(t_sent - t_first) * 1e3))

    async def Load(self, request, context):
        st = self.engine.stats()
        return load_to_pb(st, tokens_per_s=int(self._rate.update(self._prompt_tokens)))


async def _release(engine, rid: str, abort: bool) -> None:
    try:
        await engine.call(lambda e: e.abort(rid) if abort else e.release(rid))
    except Exception:  # noqa: BLE001 - engine gone; nothing left to free
        log.warning("release of %s failed", rid, exc_info=True)
