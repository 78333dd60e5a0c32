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
  and Release/Abort are sent best-effort in the background.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import AsyncIterator

import grpc

from common import telemetry
from common.convert import params_to_pb as request_params_pb
from common.metrics import ServiceMetrics
from common.telemetry import GenAI
from gateway.admission import AdmissionConfig, Decision, Predictor, decide
from gateway.admission_queue import AdmissionQueue
from gateway.routing import PrefixIndex, Replica, ReplicaPool, Route, order_decode, order_prefill
from gateway.types import FINISH_NAMES, GatewayError, GenChunk, GenRequest, invalid

log = logging.getLogger("splitserve.gateway.core")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
_END = object()  # end of a request's chunk queue


class GatewayCore:
    def __init__(self, *, model_name: str, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], prefill: ReplicaPool, decode: ReplicaPool,
                 admission: AdmissionConfig, metrics: ServiceMetrics, info: dict | None = None,
                 transfer_timeout_ms: int = 30000, prefill_on_decode: str = "never"):
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
        self._bg: set[asyncio.Task] = set()
        self.num_active = 0
        self.num_admitted = 0  # admitted requests not finished yet

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

    def _background(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _quiet(self, coro, what: str) -> None:
        try:
            await asyncio.wait_for(coro, 5.0)
        except Exception as e:  # noqa: BLE001 - best-effort cleanup
            log.debug("%s failed: %s", what, e)

    def _release(self, replica, request_id: str, transfer_id: str, reason: str) -> None:
        from protos import decode_pb2

        req = decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id, reason=reason)
        self._background(self._quiet(replica.stub.Release(req, timeout=5.0), "Release"))

    def _abort(self, replica, request_id: str, transfer_id: str, reason: str) -> None:
        from protos import decode_pb2

        req = decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id, reason=reason)
        self._background(self._quiet(replica.stub.Abort(req, timeout=5.0), "Abort"))

    # ---- admission ----------------------------------------------------------------------
    def _slos(self, req: GenRequest) -> tuple[float | None, float | None]:
        cfg = self.admission_cfg
        return (req.ttft_slo_ms if req.ttft_slo_ms is not None else cfg.default_ttft_ms,
                req.tpot_slo_ms if req.tpot_slo_ms is not None else cfg.default_tpot_ms)

    def _decide(self, req: GenRequest, waited_ms: float, route: Route | None = None) -> Decision:
        route = route if route is not None else Route()
        ids = req.prompt_token_ids
        n = len(ids)
        if route.hashes is None:
            route.hashes = self.prefix.hashes(ids)
        cached = {r.address: self.prefix.match(r.address, route.hashes, n)
                  for r in self.prefill.replicas}
        p = order_prefill(self.prefill.replicas, self.predictor, n, cached)[0]
        d = order_decode(self.decode.replicas, self.predictor)[0]
        route.prefill, route.cached = p, cached[p.address]
        pred = self.predictor.predict(p.load, d.load, n, route.cached)
        ttft, tpot = self._slos(req)
        cfg = self.admission_cfg
        dec = decide(pred, ttft, tpot, waited_ms, cfg.max_queue_ms, self.predictor.early_reject_slack())
        idle = self.num_admitted == 0 and not (p.load.queued_tokens or p.load.waiting
                                               or d.load.running or pred.decode_full)
        if dec.kind != "admit" and idle:
            # NOTE: the replicas are idle, so admitting hurts no one, and only outcomes refresh
            # the models: a calibration learned under a load that is gone must not turn every
            # request away for good. Still rejected: what the uncalibrated model says not even
            # an idle replica can do (a tiny SLO).
            idle_t = self.predictor.prefill_ms(p.load, n, route.cached)[1]
            idle_p = self.predictor.tpot_ms(d.load)[1]
            if (ttft is None or idle_t <= ttft) and (tpot is None or idle_p <= tpot):
                return Decision("admit", "idle probe: nothing admitted is running", pred)
        # one more sequence slows every running one: the tightest TPOT SLO there must hold too
        # (waiting helps: running requests finish)
        if dec.kind == "admit" and d.tpot_slos and pred.tpot_ms > min(d.tpot_slos):
            what = (f"predicted TPOT {pred.tpot_ms:.1f} ms would slow a running request past its "
                    f"tpot_ms={min(d.tpot_slos):g}")
            budget = min(cfg.max_queue_ms, ttft - pred.idle_ttft_ms if ttft is not None else math.inf)
            if waited_ms >= budget:
                return Decision("reject", what + f" (queued {waited_ms:.0f} ms, no more time left)",
                                pred, retry_after_s=1.0)
            return Decision("queue", what, pred, retry_after_s=1.0)
        return dec

    async def admit(self, req: GenRequest, route: Route | None = None) -> Decision:
        """Admit (route filled in, the prompt counted in its prefill replica's in-flight
        tokens), or raise RESOURCE_EXHAUSTED with a Retry-After from the prediction."""
        route = route if route is not None else Route()
        with telemetry.span("gateway.admission") as sp:
            queued = False

            def fn(waited_ms: float) -> Decision:
                nonlocal queued
                d = self._decide(req, waited_ms, route)
                if d.kind == "queue" and not queued:
                    queued = True
                    self.metrics.admission.labels(decision="queue").inc()
                    self.metrics.waiting.inc()
                return d

            ttft_slo, _ = self._slos(req)
            budget = min(ttft_slo if ttft_slo is not None else math.inf,
                         self.admission_cfg.max_queue_ms)
            try:
                d = await self.queue.run(fn, req.priority, deadline=req.arrival + budget / 1e3)
            finally:
                if queued:
                    self.metrics.waiting.dec()
            self.metrics.admission.labels(decision=d.kind).inc()
            if d.prediction is not None:
                self.metrics.predicted_ttft.observe(d.prediction.ttft_ms / 1e3)
                self.metrics.predicted_tpot.observe(d.prediction.tpot_ms / 1e3)
                telemetry.set_attrs(sp, {"splitserve.predicted_ttft_ms": d.prediction.ttft_ms,
                                         "splitserve.predicted_tpot_ms": d.prediction.tpot_ms,
                                         "splitserve.predicted_cached_tokens": route.cached})
            sp.set_attribute("splitserve.admission.decision", d.kind)
            sp.set_attribute("splitserve.admission.queued", queued)
            if d.kind == "reject":
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"admission rejected request {req.request_id}: {d.reason}",
                                   retry_after_s=max(d.retry_after_s, 1.0))
            route.prediction, route.t_decided = d.prediction, time.monotonic()
            route.admitted = True
            self.num_admitted += 1
            route.inflight = max(len(req.prompt_token_ids) - route.cached, 1)
            route.prefill.add_inflight(route.inflight)
            return d

    def _observe_outcome(self, req: GenRequest, route: Route, ttft_ms: float | None,
                         tpot_ms: float | None) -> None:
        """One admitted request's prediction against what it got: calibration + metrics."""
        pred = route.prediction
        if pred is None:
            return
        et, ep = self.predictor.observe_outcome(pred, ttft_ms, tpot_ms)
        m = self.metrics
        est_t = pred.est_ttft_ms if pred.est_ttft_ms is not None else pred.ttft_ms
        est_p = pred.est_tpot_ms if pred.est_tpot_ms is not None else pred.tpot_ms
        for what, err, got, want, cal in (("ttft", et, ttft_ms, est_t, self.predictor.ttft_cal),
                                          ("tpot", ep, tpot_ms, est_p, self.predictor.tpot_cal)):
            if err is None:
                continue
            m.prediction_ratio.labels(what=what).observe(got / want)
            m.prediction_mape.labels(what=what).set(cal.mape())
            offset, scale = cal.coef()
            m.prediction_correction.labels(what=what, term="scale").set(scale)
            m.prediction_correction.labels(what=what, term="offset_ms").set(offset)
            log.debug("request %s %s predicted %.1f ms, got %.1f ms (%.0f%% off)", req.request_id,
                      what.upper(), want, got, err * 100)

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

    # ---- downstream calls ---------------------------------------------------------------
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
        code = last.code() if last is not None else grpc.StatusCode.UNAVAILABLE
        retry = 1.0 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        raise GatewayError(code, f"no decode replica could reserve KV for {len(req.prompt_token_ids)}"
                           f" tokens ({', '.join(r.address for r in self.decode.replicas)}): "
                           f"{last.details() if last is not None else 'none configured'}",
                           retry_after_s=retry)

    async def _reserve_once(self, req: GenRequest):
        """-> (replica, ticket, None) or (None, None, last error)."""
        from protos import decode_pb2

        last = None
        for r in order_decode(self.decode.replicas, self.predictor):
            with telemetry.span("decode.Reserve", kind=telemetry.SpanKind.CLIENT,
                                attributes={"splitserve.replica": r.address}):
                try:
                    resp = await r.stub.Reserve(decode_pb2.ReserveRequest(
                        request_id=req.request_id, num_prompt_tokens=len(req.prompt_token_ids),
                        max_tokens=req.params.max_tokens), timeout=10.0,
                        metadata=telemetry.inject_metadata())
                    return r, resp.ticket, None
                except grpc.aio.AioRpcError as e:
                    last = e
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        r.mark_down(f"Reserve: {e.details()}")
                        continue
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue
                    raise GatewayError(e.code(), f"decode Reserve failed: {e.details()}") from None
        return None, None, last

    async def _prefill(self, req: GenRequest, route: Route | None = None):
        """-> (decode replica, ticket, PrefillResponse). Tries the replica admission chose
        first, then the others."""
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
            dec, ticket = await self._reserve(req)
            tried.append(p.address)
            if ticket.block_size and ticket.block_size != self.prefix.block_size:
                self.prefix.set_block_size(ticket.block_size)
                route.hashes = None
            if route.hashes is None:
                route.hashes = self.prefix.hashes(ids)
            self.prefix.record(p.address, route.hashes, p.load.num_total_blocks)
            held = 0 if p is route.prefill and route.inflight else n
            if held:
                p.add_inflight(held)
            # NOTE: prefill_ms runs from the replica's receipt, its own queue included: only a
            # prompt sent to an otherwise idle replica times the compute the fit models
            route.alone = p.load.inflight_requests == 1 and not p.load.queued_tokens
            try:
                with telemetry.span("prefill.Prefill", kind=telemetry.SpanKind.CLIENT,
                                    attributes={"splitserve.replica": p.address}):
                    resp = await p.stub.Prefill(prefill_pb2.PrefillRequest(
                        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                        params=params_pb, ticket=ticket), metadata=telemetry.inject_metadata())
                m = self.metrics.routing_prefix_tokens
                m.labels(kind="prompt").inc(n)
                m.labels(kind="predicted").inc(route.cached if p is route.prefill else 0)
                m.labels(kind="cached").inc(resp.num_cached_tokens)
                return dec, ticket, resp
            except grpc.aio.AioRpcError as e:
                self._release(dec, req.request_id, ticket.transfer_id, f"prefill failed: {e.code().name}")
                last = e
                if e.code() in _RETRYABLE:
                    p.mark_down(f"Prefill: {e.details()}")
                    self.prefix.forget(p.address)
                    continue
                raise GatewayError(e.code(), f"prefill failed: {e.details()}") from None
            except BaseException:
                self._release(dec, req.request_id, ticket.transfer_id, "cancelled during prefill")
                raise
            finally:
                if held:
                    p.done_inflight(held)
                elif p is route.prefill:
                    route.settle()
                self.queue.notify()
        raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                           f"no prefill replica available (tried {', '.join(tried)}): "
                           f"{last.details() if last is not None else 'none'}")

    # ---- the one path -------------------------------------------------------------------
    async def generate(self, req: GenRequest, metadata=None) -> AsyncIterator[GenChunk]:
        """Async iterator of GenChunk; raises GatewayError (status + message).
        metadata: incoming gRPC metadata / HTTP headers carrying the client's trace context.

        NOTE: the pipeline runs in its own task feeding a queue, so its spans are attached and
        detached in one context whatever task consumes this iterator; closing the iterator
        (client gone) cancels that task, which cancels the downstream RPCs."""
        self.check_prompt(req.prompt_token_ids)
        q: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._run(req, metadata, q))
        try:
            while True:
                item = await q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not task.done():
                task.cancel()

    async def _run(self, req: GenRequest, metadata, q: asyncio.Queue) -> None:
        # NOTE: without an incoming traceparent keep the current context (e.g. the HTTP server's
        # span) instead of starting from an empty one
        ctx = telemetry.extract_context(metadata) if telemetry.has_trace_context(metadata) else None
        outcome = "error"
        self.num_active += 1
        self.metrics.running.inc()
        route = Route()
        try:
            with telemetry.span("gateway.generate", kind=telemetry.SpanKind.SERVER, context=ctx,
                                attributes={**telemetry.request_attributes(
                                    self.model_name, req.params, req.operation),
                                    "splitserve.request_id": req.request_id}) as sp:
                async for chunk in self._generate(req, sp, route):
                    if chunk.finish_reason:
                        outcome = chunk.finish_reason
                    q.put_nowait(chunk)
        except asyncio.CancelledError:
            outcome = "abort"
            raise
        except GatewayError as e:
            outcome = "rejected" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
            q.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - surfaced to the client as INTERNAL
            log.exception("request %s failed", req.request_id)
            q.put_nowait(GatewayError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            route.release_decode()
            if route.admitted:
                self.num_admitted -= 1
            q.put_nowait(_END)
            self.num_active -= 1
            self.metrics.running.dec()
            self.metrics.requests.labels(outcome=outcome).inc()
            self.queue.notify()

    async def _generate(self, req: GenRequest, sp, route: Route | None = None
                        ) -> AsyncIterator[GenChunk]:
        route = route if route is not None else Route()
        await self.admit(req, route)  # raises RESOURCE_EXHAUSTED when rejected
        t_admitted = time.monotonic()
        self.metrics.queue_time.observe(t_admitted - req.arrival)
        dec = self._decode_here(route)  # prefill on the decode replica itself (or None: split)
        ticket = pre = None
        try:
            if dec is None:
                dec, ticket, pre = await self._prefill(req, route)
        finally:
            route.settle()
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
            ttft_ms = (t_first - req.arrival) * 1e3
            self._observe_outcome(req, route, (t_first - route.t_decided) * 1e3, None)
            self.metrics.ttft.observe(ttft_ms / 1e3)
            sp.set_attribute(GenAI.TTFT, ttft_ms / 1e3)
            pt = pre.timings if pre is not None else None
            timings.update(ttft_ms=ttft_ms, queue_ms=(t_admitted - req.arrival) * 1e3
                           + (pt.queue_ms if pt else 0.0),
                           prefill_ms=pt.prefill_ms if pt else ttft_ms - (t_admitted - req.arrival) * 1e3,
                           transfer_ms=pt.transfer_ms if pt else 0.0)

        def finish_chunk(ids, text, lps, reason, stop_reason="") -> GenChunk:
            now = time.monotonic()
            total_ms = (now - req.arrival) * 1e3
            tpot = (now - t_first) / (n_gen - 1) if n_gen > 1 and t_first is not None else None
            if tpot is not None:
                self._observe_outcome(req, route, None, tpot * 1e3)
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
                self._release(dec, req.request_id, ticket.transfer_id, "finished at the first token")
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
            with telemetry.span("decode.Decode", kind=telemetry.SpanKind.CLIENT,
                                attributes={"splitserve.replica": dec.address}):
                call = dec.stub.Decode(decode_pb2.DecodeRequest(
                    request_id=req.request_id, transfer_id=ticket.transfer_id if ticket else "",
                    prompt_token_ids=req.prompt_token_ids,
                    first_token_id=pre.first_token_id if pre is not None else 0,
                    params=request_params_pb(params), detokenize=False,
                    transfer_timeout_ms=self.transfer_timeout_ms, prefill_here=pre is None),
                    metadata=telemetry.inject_metadata())
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
