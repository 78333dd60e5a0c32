"""REST bridge (FastAPI): OpenAI-compatible /v1/completions, /v1/chat/completions (SSE stream
or one JSON), /v1/models, vLLM's /tokenize and /detokenize, /health, /metrics. A thin
translation onto GatewayCore.generate (request bodies and errors: openai_api.py).

SSE framing: each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`.
An error after the stream started is sent as one `data: {"error": ...}` event before [DONE]
(the HTTP status is already 200 by then).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway import openai_api as oa
from gateway.core import GatewayCore
from gateway.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, openapi_body
from gateway.types import GatewayError
from gateway.validate import Limits, read_json_body

log = logging.getLogger("splitserve.gateway.rest")

_ERR_TYPE = {400: "invalid_request_error", 404: "not_found_error", 409: "invalid_request_error",
             415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
             504: "timeout"}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def error_body(e: GatewayError) -> dict:
    status = e.http_status
    etype = getattr(e, "openai_type", None) or _ERR_TYPE.get(status, "server_error")
    code = getattr(e, "openai_code", None) or e.code.name.lower()
    return {"error": {"message": e.message, "type": etype, "param": e.param, "code": code}}


def error_response(e: GatewayError) -> JSONResponse:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    return JSONResponse(error_body(e), status_code=e.http_status, headers=headers)


_GONE = object()  # the client hung up before the first chunk


async def _disconnected(request: Request) -> None:
    # NOTE: the body is fully read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(core: GatewayCore, *, default_max_tokens: int | None = None,
              max_body_bytes: int = 1 << 20, max_tokens_over_context: str = "error") -> FastAPI:
    """default_max_tokens: for requests without max_tokens; None = until an end token or the
    end of the context. max_tokens_over_context: "error" (400) or "cap"."""
    # /openapi.json documents every route and request body (the property tests generate from it)
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None)
    served = [core.model_name]
    limits = Limits(core.max_model_len, core.vocab_size, default_max_tokens,
                    max_tokens_over_context, max_body_bytes)

    @app.exception_handler(GatewayError)
    async def _gw_error(request: Request, e: GatewayError):
        return error_response(e)

    @app.get("/health")
    async def health():
        ok = core.replicas_up()  # colocated (prefill on decode): a prefill replica is not needed
        body = {"status": "draining" if core.draining else "ok" if ok else "degraded",
                "prefill": [{"address": r.address, "healthy": r.healthy, "error": r.last_error}
                            for r in core.prefill.replicas],
                "decode": [{"address": r.address, "healthy": r.healthy, "error": r.last_error}
                           for r in core.decode.replicas]}
        return JSONResponse(body, status_code=200 if ok and not core.draining else 503)

    @app.get("/metrics")
    async def metrics():
        data, ctype = core.metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "splitserve",
             "max_model_len": core.max_model_len} for m in served]}

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeBody))
    async def tokenize(request: Request):
        return await oa.tokenize(await read_json_body(request, max_body_bytes), core, served)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeBody))
    async def detokenize(request: Request):
        return oa.detokenize(await read_json_body(request, max_body_bytes), core, served)

    async def handle(request: Request, kind: str):
        body = await read_json_body(request, max_body_bytes)
        parse = oa.parse_chat if kind == "chat" else oa.parse_completion
        pr = await parse(body, core, served, limits)
        headers = dict(request.headers)  # carries traceparent when the client sent one
        rid = oa.new_id(kind)
        model = core.model_name
        agen = core.generate(pr.gen, metadata=headers)
        if not pr.stream:
            return await _collect_unless_gone(request, agen, pr, rid, model)
        # pull the first chunk before answering so admission/validation errors get real statuses;
        # a client gone meanwhile cancels it (its prefill and decode reservation freed at once)
        first = await _first_unless_gone(request, agen)
        if first is _GONE:
            return Response(status_code=499)
        return StreamingResponse(_stream(agen, first, pr, rid, model), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": pr.gen.request_id})

    async def _first_unless_gone(request: Request, agen):
        async def first():
            try:
                return await agen.__anext__()
            except StopAsyncIteration:
                return None

        task = asyncio.ensure_future(first())
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()  # NOTE: unwinds the generator inside it: the downstream RPCs are cancelled
            await asyncio.wait([task])
            return _GONE
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()

    async def _collect_unless_gone(request: Request, agen, pr, rid, model):
        """Non-streaming: a client that hangs up mid-generation cancels it (blocks freed)."""
        task = asyncio.ensure_future(_collect(agen, pr, rid, model))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            # NOTE: cancelling the task unwinds the generator inside it (its finally cancels
            # the downstream RPCs); aclose() here would race the running task
            task.cancel()
            await asyncio.wait([task])
            return Response(status_code=499)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()

    async def _collect(agen, pr, rid, model):
        text, lps, finish, usage, off, timings = "", None, None, None, 0, None
        async for c in agen:
            lps = oa.merge_logprobs(pr.kind, lps, oa.logprobs_json(pr.kind, core.tokenizer, c, off))
            text += c.text
            off = len(text)
            if c.finish_reason:
                finish, usage, timings = c.finish_reason, c.usage, c.timings
        return JSONResponse(oa.full_response(pr.kind, rid, model, text, finish, lps, usage,
                                             timings))

    async def _stream(agen, first, pr, rid, model):
        created = int(time.time())
        off, usage, is_first, timings = 0, None, True, None
        try:
            chunk = first
            while chunk is not None:
                lp = oa.logprobs_json(pr.kind, core.tokenizer, chunk, off)
                off += len(chunk.text)
                if chunk.finish_reason:
                    usage, timings = chunk.usage, chunk.timings
                if chunk.text or chunk.finish_reason or lp or is_first:
                    yield sse(oa.stream_chunk(pr.kind, rid, model, created, chunk.text,
                                              chunk.finish_reason, lp, first=is_first))
                    is_first = False
                try:
                    chunk = await agen.__anext__()
                except StopAsyncIteration:
                    chunk = None
            if pr.include_usage and usage:
                yield sse({"id": rid, "object": "chat.completion.chunk" if pr.kind == "chat"
                           else "text_completion", "created": created, "model": model,
                           "choices": [], "usage": oa.usage_json(usage),
                           **oa.timings_json(timings)})
        except GatewayError as e:
            yield sse(error_body(e))
        finally:
            # NOTE: the client went away (or we are done): close the generator so the
            # downstream decode stream is cancelled and its blocks are freed
            await agen.aclose()
        yield sse("[DONE]")

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatBody))
    async def chat(request: Request):
        return await handle(request, "chat")

    return app
