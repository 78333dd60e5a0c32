"""GatewayCore: the one internal path both fronts (gRPC Generate, REST) go through.

Per request:  validate -> admission (admit / queue / reject; picks the prefill replica, prefix
cache hits included) -> pick decode replica -> decode.Reserve (ticket) -> prefill.Prefill(ticket)
(first token) -> decode.Decode stream -> chunks to the client (text by incremental detokenizing +
stop strings). The admitted request's predicted TTFT / TPOT are compared with what it got
(Predictor.observe_outcome: calibration and the prediction-error metrics).

Failure handling (invariant: nothing stays allocated downstream once generate() exits):
- prefill UNAVAILABLE -> release the reservation, reserve again, try the next prefill replica;
  none left -> UNAVAILABLE naming the replicas and the last error;
- decode stream error -> the client's stream ends with that status (UNAVAILABLE when it died);
- client cancel / generator closed -> the in-flight RPC is cancelled (which aborts downstream)
  and Release/Abort are sent best-effort in the background;
- no replica of a role up (dead, frozen: its Load poll failed) -> UNAVAILABLE + Retry-After at
  once (gateway/downstream.py);
- draining (SIGTERM) -> new requests get UNAVAILABLE + Retry-After, running ones finish.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from common import telemetry
from common.convert import params_to_pb as request_params_pb
from common.metrics import ServiceMetrics
from common.outbox import Outbox
from common.telemetry import GenAI, SpanKind
from gateway.admission import AdmissionConfig, Predictor
from gateway.admission_queue import AdmissionQueue
from gateway.admit_path import AdmitPath
from gateway.decode_many import DECODE_SERVICE
from gateway.downstream import Downstream
from gateway.routing import PrefixIndex, Replica, ReplicaPool, Route, order_decode
from gateway.types import (FINISH_NAMES, GatewayError, GenChunk, GenRequest, invalid, merge_chunks,
                           prediction_timings)

log = logging.getLogger("splitserve.gateway.core")
_END = object()  # end of a request's chunk queue
DRAIN_RETRY_AFTER_S = 5.0  # clients of a draining gateway: another instance takes over meanwhile


class GatewayCore(AdmitPath, Downstream):
    def __init__(self, *, model_name: str, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], prefill: ReplicaPool, decode: ReplicaPool,
                 admission: AdmissionConfig, metrics: ServiceMetrics, info: dict | None = None,
                 transfer_timeout_ms: int = 30000, prefill_on_decode: str = "never",
                 decode_streams: str = "many", reserve_overlap: str = "auto"):
        self.model_name = model_name
        self.tokenizer = tokenizer  # engine.tokenizer.Tokenizer or None (token ids only)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.prefill, self.decode = prefill, decode
        self.admission_cfg = admission
        self.predictor = Predictor(admission)
        self.queue = AdmissionQueue()
        self.prefix = PrefixIndex()
        self.metrics = metrics
        self.info = info or {}
        self.transfer_timeout_ms = transfer_timeout_ms
        self.prefill_on_decode = prefill_on_decode  # gateway/config.py PREFILL_ON_DECODE
        self.decode_streams = decode_streams  # gateway/config.py DECODE_STREAMS
        self.reserve_overlap = reserve_overlap  # gateway/config.py RESERVE_OVERLAP
        self._bg: set[asyncio.Task] = set()
        self.num_active = 0
        self.num_admitted = 0  # admitted requests not finished yet
        self._request_ids: set[str] = set()  # ids of the requests in flight (unique)
        self.draining = False  # set once on shutdown: no new request is taken from then on

    # ---- drain --------------------------------------------------------------------------
    def start_drain(self) -> None:
        self.draining = True
        self.queue.notify()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no request runs (True) or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.num_active

    # ---- helpers ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return "req-" + uuid.uuid4().hex[:16]

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise invalid("prompt is empty (0 tokens)", param="prompt")
        if len(ids) >= self.max_model_len:
            raise invalid(f"prompt is too long: {len(ids)} tokens, the model's context is "
                          f"{self.max_model_len} (prompt must leave room for >= 1 new token)",
                          param="prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} is out of range [0, {self.vocab_size})", param="prompt")

    def _prefills_here(self, p: Replica, d: Replica) -> bool:
        """Whether decode replica d prefills a prompt admission routed to prefill replica p
        (--prefill-on-decode always; auto: both on one GPU)."""
        mode = self.prefill_on_decode
        return d.healthy and (mode == "always" or (
            mode == "auto" and d.load.device_id.startswith("cuda:")
            and d.load.device_id == p.load.device_id))

    def _decode_here(self, route: Route) -> Replica | None:
        """The decode replica that prefills this request itself, or None (split). --prefill-on-
        decode auto: when the prefill replica admission chose shares the decode replica's GPU
        (the two processes time-share it; the decode engine folds the prompt into its own
        steps instead of a handoff)."""
        mode = self.prefill_on_decode
        if mode == "never":
            return None
        for d in order_decode(self.decode.replicas, self.predictor):
            if not d.healthy:
                continue
            if mode == "always":
                return d
            p = route.prefill
            if p is not None and d.load.device_id.startswith("cuda:") and d.load.device_id == p.load.device_id:
                return d
            return None
        return None

    # ---- the one path -------------------------------------------------------------------
    async def generate(self, req: GenRequest, metadata=None) -> AsyncIterator[GenChunk]:
        """Async iterator of GenChunk; raises GatewayError (status + message).
        metadata: incoming gRPC metadata / HTTP headers carrying the client's trace context.

        NOTE: the pipeline runs in its own task feeding a queue, so its spans are attached and
        detached in one context whatever task consumes this iterator; closing the iterator
        (client gone) cancels that task, which cancels the downstream RPCs."""
        if self.draining:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down (draining)",
                               retry_after_s=DRAIN_RETRY_AFTER_S)
        self.check_prompt(req.prompt_token_ids)
        if req.request_id in self._request_ids:
            # NOTE: the services key reservations and aborts by request id: a second holder
            # would fail both, so it is refused here and the first goes on unharmed
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id!r} "
                               "is in use by a request in flight", param="request_id")
        self._request_ids.add(req.request_id)
        loop = asyncio.get_running_loop()
        q = Outbox(loop)
        task = loop.create_task(self._run(req, metadata, q))
        try:
            while True:
                # NOTE: what queued while the consumer wrote to a slow client leaves as one chunk
                for item in merge_chunks(await q.take()):
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            self._request_ids.discard(req.request_id)
            if not task.done():
                task.cancel()

    async def _run(self, req: GenRequest, metadata, q: Outbox) -> None:
        outcome = "error"
        self.num_active += 1
        self.metrics.running.inc()
        route = Route()
        try:
            with telemetry.request_span(req.operation, self.model_name, req.params,
                                        req.request_id, metadata, arrival=req.arrival) as sp:
                async for chunk in self._generate(req, sp, route):
                    if chunk.finish_reason:
                        outcome = chunk.finish_reason
                    q.put(chunk)
        except asyncio.CancelledError:
            outcome = "abort"
            raise
        except GatewayError as e:
            outcome = "rejected" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
            q.put(e)
        except Exception as e:  # noqa: BLE001 - surfaced to the client as INTERNAL
            log.exception("request %s failed", req.request_id)
            q.put(GatewayError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            route.release_decode()
            route.settle()
            if route.admitted:
                self.num_admitted -= 1
            q.put(_END)
            self.num_active -= 1
            self.metrics.running.dec()
            self.metrics.requests.labels(outcome=outcome).inc()
            self.queue.notify()

    async def _generate(self, req: GenRequest, sp, route: Route | None = None
                        ) -> AsyncIterator[GenChunk]:
        route = route if route is not None else Route()
        self.check_replicas_up()  # raises UNAVAILABLE + Retry-After at once
        await self.admit(req, route)  # raises RESOURCE_EXHAUSTED when rejected
        t_admitted = time.monotonic()
        self.metrics.queue_time.observe(t_admitted - req.arrival)
        dec = self._decode_here(route)  # prefill on the decode replica itself (or None: split)
        if dec is not route.here:
            route.settle()  # admission's guess of where it prefills no longer holds
            route.here = None
        ticket = pre = None
        try:
            if dec is None:
                dec, ticket, pre = await self._prefill(req, route)
        finally:
            if route.here is None:
                route.settle()  # prefilled here: settled at its first token
        route.hold_decode(dec, self._slos(req)[1])
        if pre is not None and route.alone:
            pt = pre.timings
            self.predictor.observe_prefill(len(req.prompt_token_ids) - pre.num_cached_tokens,
                                           pt.prefill_ms, pt.transfer_ms)
        params = req.params
        detok = (self.tokenizer.detokenizer(req.prompt_token_ids, params)
                 if self.tokenizer is not None and req.want_text else None)
        n_prompt, n_gen = len(req.prompt_token_ids), 0
        cached = pre.num_cached_tokens if pre is not None else 0
        t_first = ttft_ms = None
        timings: dict = {}

        def first_token_out() -> None:
            nonlocal t_first, ttft_ms
            t_first = time.monotonic()
            route.settle(finished=True)
            ttft_ms = (t_first - req.arrival) * 1e3
            got_ms = (t_first - route.t_decided) * 1e3
            self._observe_outcome(req, route, got_ms, None)
            self._observe_slo(req, route, ttft_ms=ttft_ms)
            if pre is None and route.alone and route.prediction is not None:
                # prefilled here with nothing of ours ahead: the here fit's sample
                pr = route.prediction
                self.predictor.observe_prefill_here(
                    len(req.prompt_token_ids), got_ms,
                    pr.raw_tpot_ms if pr.raw_tpot_ms is not None else pr.tpot_ms)
            self.metrics.ttft.observe(ttft_ms / 1e3)
            sp.set_attribute(GenAI.TTFT, ttft_ms / 1e3)
            pt = pre.timings if pre is not None else None
            timings.update(ttft_ms=ttft_ms, queue_ms=(t_admitted - req.arrival) * 1e3
                           + (pt.queue_ms if pt else 0.0),
                           prefill_ms=pt.prefill_ms if pt else ttft_ms - (t_admitted - req.arrival) * 1e3,
                           transfer_ms=pt.transfer_ms if pt else 0.0)
            if route.prediction is not None:
                timings.update(prediction_timings(route.prediction, route.t_decided - req.arrival))

        def finish_chunk(ids, text, lps, reason, stop_reason="") -> GenChunk:
            now = time.monotonic()
            total_ms = (now - req.arrival) * 1e3
            tpot = (now - t_first) / (n_gen - 1) if n_gen > 1 and t_first is not None else None
            if tpot is not None:
                self._observe_outcome(req, route, None, tpot * 1e3)
                self._observe_slo(req, route, tpot_ms=tpot * 1e3)
                self.metrics.tpot.observe(tpot)
            self.metrics.e2e.observe(total_ms / 1e3)
            self.metrics.prompt_tokens.inc(n_prompt)
            self.metrics.generation_tokens.inc(n_gen)
            self.metrics.request_prompt_tokens.observe(n_prompt)
            self.metrics.request_generation_tokens.observe(n_gen)
            telemetry.set_attrs(sp, telemetry.usage_attributes(
                n_prompt, n_gen, cached_tokens=cached,
                ttft_s=ttft_ms / 1e3 if ttft_ms is not None else None,
                tpot_s=tpot, e2e_s=total_ms / 1e3, finish_reason=reason))
            return GenChunk(ids, text, lps, reason, stop_reason,
                            usage={"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                                   "cached_tokens": cached},
                            timings={**timings, "total_ms": total_ms})

        # ---- first token (sampled by prefill; prefilled here: it comes with the decode stream)
        if pre is not None:
            first_token_out()
            first = pre.first_token_id
            n_gen = 1
            text, stop = detok.step([first]) if detok else ("", None)
            lps = [pre.first_logprob] if params.logprobs is not None and pre.HasField("first_logprob") else []
            reason = None
            if stop is not None:
                reason = "stop"
            elif first in params.stop_token_ids or (first in self.eos_token_ids and not params.ignore_eos):
                reason = "stop"
            elif params.max_tokens <= 1 or n_prompt + 1 >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._release(dec, req.request_id, ticket.transfer_id, "finished at the first token",
                              await_kv=True)
                if detok and stop is None:
                    text += detok.flush()
                yield finish_chunk([first], text, lps, reason, stop or "")
                return
            yield GenChunk([first], text, lps, timings={"ttft_ms": ttft_ms})

        # ---- the rest (decode stream)
        from protos import decode_pb2

        call = None
        done = False
        try:
            many = self.decode_streams == "many"
            with telemetry.span("decode.Decode", kind=SpanKind.CLIENT if many else SpanKind.INTERNAL,
                                attributes={"splitserve.replica": dec.address, **(
                                    {"rpc.system": "grpc", "rpc.service": DECODE_SERVICE,
                                     "rpc.method": "DecodeMany"} if many else {})}):
                call = self._decode_call(dec, decode_pb2.DecodeRequest(
                    request_id=req.request_id, transfer_id=ticket.transfer_id if ticket else "",
                    prompt_token_ids=req.prompt_token_ids,
                    first_token_id=pre.first_token_id if pre is not None else 0,
                    params=request_params_pb(params), detokenize=False,
                    transfer_timeout_ms=self.transfer_timeout_ms, prefill_here=pre is None,
                    tpot_ms=_budget_ms(self._slos(req)[1])))
                t_last = time.monotonic()
                async for resp in call:
                    ids = list(resp.token_ids)
                    now = time.monotonic()
                    if ids and t_first is None:  # prefilled here: the first token
                        first_token_out()
                        if len(ids) > 1:
                            gap = (now - t_last) / (len(ids) - 1)
                            self.metrics.itl.observe(gap)
                    elif ids:
                        gap = (now - t_last) / len(ids)
                        for _ in ids:
                            self.metrics.itl.observe(gap)
                        self.predictor.observe_decode_gap(gap * 1e3, dec.load.running or 1)
                        t_last = now
                    n_gen += len(ids)
                    text, stop = detok.step(ids) if detok else ("", None)
                    lps = list(resp.logprobs) if params.logprobs is not None else []
                    fr = FINISH_NAMES.get(resp.finish_reason)
                    if stop is not None:  # the gateway's detokenizer saw a stop string first
                        done = True
                        yield finish_chunk(ids, text, lps, "stop", stop)
                        return
                    if fr is not None:
                        done = True
                        if detok:
                            text += detok.flush()
                        yield finish_chunk(ids, text, lps, fr, resp.stop_reason)
                        return
                    if ids or text:
                        yield GenChunk(ids, text, lps, timings={"ttft_ms": ttft_ms}
                                       if n_gen == len(ids) and pre is None else None)
                done = True
                # stream ended without a finish reason: the decode side gave up silently
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   f"decode replica {dec.address} ended the stream without finishing")
        except grpc.aio.AioRpcError as e:
            done = True
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                dec.mark_down(f"Decode: {e.details()}")
                raise GatewayError(e.code(), f"decode replica {dec.address} unavailable: "
                                   f"{e.details()}") from None
            raise GatewayError(e.code(), f"decode failed: {e.details()}") from None
        finally:
            if call is not None and not call.done():
                call.cancel()  # NOTE: cancelling the stream aborts the request downstream
            if not done:
                self._abort(dec, req.request_id, ticket.transfer_id if ticket else "",
                            "client went away")


def _budget_ms(tpot_slo_ms: float | None) -> int:
    """DecodeRequest.tpot_ms: whole milliseconds, 0 for none."""
    return 0 if tpot_slo_ms is None or tpot_slo_ms <= 0 else max(1, min(int(tpot_slo_ms), 2**32 - 1))
