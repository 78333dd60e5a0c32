"""DecodeMany: many requests' Decode streams on one call (decode.proto).

Each `start` runs the ordinary Decode handler in its own task, against a per-request view of
the call's context (its metadata plus the request's trace context; abort() ends that request
only), and a writer sends whatever all of them produced since its last write as one batch.
At 64 running requests that is one gRPC message a step instead of 64, on both ends.
DecodeServicer (decode_svc/servicer.py) inherits it.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging

import grpc

from common.convert import merge_decode_response
from protos import decode_pb2

log = logging.getLogger("splitserve.decode")

_TRACE_KEYS = ("traceparent", "tracestate", "baggage")


class RequestAborted(Exception):
    """_RequestContext.abort(): the request ends with this status (the call goes on)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _RequestContext:
    """What Decode reads of its servicer context, for one request of a DecodeMany call."""

    def __init__(self, call_context, trace_context: dict, emit=None):
        md = [(k, v) for k, v in (call_context.invocation_metadata() or ()) if k not in _TRACE_KEYS]
        self._md = tuple(md) + tuple((str(k).lower(), str(v)) for k, v in trace_context.items())
        self._call = call_context
        # Decode hands each message to emit as the step makes it (StreamingMixin._stream_batched)
        self.emit = emit

    def invocation_metadata(self):
        return self._md

    def peer(self) -> str:
        return self._call.peer()

    async def abort(self, code, details: str = "", trailing_metadata=()):
        raise RequestAborted(code, details)


class ManyMixin:
    """Needs Decode (DecodeServicer)."""

    async def DecodeMany(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}
        loop = asyncio.get_running_loop()

        async def run_one(req: decode_pb2.DecodeRequest, ctx: _RequestContext) -> None:
            rid = req.request_id
            try:
                async for resp in self.Decode(req, ctx):
                    out.put_nowait(decode_pb2.DecodeManyItem(request_id=rid, response=resp))
            except RequestAborted as e:
                out.put_nowait(_error(rid, e.code, e.details))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - this request's failure, not the call's
                log.exception("decode of %s failed", rid)
                out.put_nowait(_error(rid, grpc.StatusCode.INTERNAL, f"decode failed: {e}"))
            finally:
                if tasks.get(rid) is asyncio.current_task():
                    del tasks[rid]
                out.put_nowait(None)  # wakes the writer: the call may be over

        def start(st: decode_pb2.DecodeManyStart) -> None:
            rid = st.request.request_id
            if rid in tasks:
                out.put_nowait(_error(rid, grpc.StatusCode.INVALID_ARGUMENT,
                                      f"request {rid!r} is already running on this call"))
                return
            def emit(resp, rid=rid) -> None:
                out.put_nowait(decode_pb2.DecodeManyItem(request_id=rid, response=resp))

            ctx = _RequestContext(context, dict(st.trace_context), emit)
            # NOTE: a fresh contextvars context: its spans continue the request's own trace,
            # not the long-lived call's
            tasks[rid] = loop.create_task(run_one(st.request, ctx), context=contextvars.Context())

        async def read() -> None:
            async for m in request_iterator:
                for st in m.starts:
                    start(st)
                for rid in m.cancel_request_ids:
                    t = tasks.pop(rid, None)
                    if t is not None:
                        t.cancel()  # as a cancelled Decode call: aborts the request
            out.put_nowait(None)

        reader = loop.create_task(read())
        try:
            while True:
                items = [await out.get()]
                while not out.empty():
                    items.append(out.get_nowait())
                items = _merged(items)
                if items:
                    yield decode_pb2.DecodeManyBatch(items=items)
                if reader.done() and not tasks:
                    reader.result()  # a broken request stream ends the call with its error
                    return
        finally:
            reader.cancel()
            for t in list(tasks.values()):
                t.cancel()


def _merged(items: list) -> list:
    """The batch: None wake-ups dropped, and one item per request (its messages that queued
    while the writer waited on a slow reader merged, in order; an error ends its request)."""
    out: list = []
    last: dict[str, decode_pb2.DecodeManyItem] = {}
    for it in items:
        if it is None:
            continue
        prev = last.get(it.request_id)
        if prev is not None and not prev.error_code and not it.error_code \
                and not prev.response.finish_reason:
            merge_decode_response(prev.response, it.response)
            continue
        last[it.request_id] = it
        out.append(it)
    return out


def _error(rid: str, code: grpc.StatusCode, details: str) -> decode_pb2.DecodeManyItem:
    return decode_pb2.DecodeManyItem(request_id=rid, error_code=code.value[0], error_message=details)
