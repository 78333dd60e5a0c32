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
from common.outbox import Outbox
from decode_svc.stream_state import is_plain, response
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
        loop = asyncio.get_running_loop()
        out = Outbox(loop)
        tasks: dict[str, asyncio.Task] = {}

        async def run_one(req: decode_pb2.DecodeRequest, ctx: _RequestContext) -> None:
            rid = req.request_id
            try:
                async for resp in self.Decode(req, ctx):
                    out.put(decode_pb2.DecodeManyItem(request_id=rid, response=resp))
            except RequestAborted as e:
                out.put(_error(rid, e.code, e.details))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - this request's failure, not the call's
                log.exception("decode of %s failed", rid)
                out.put(_error(rid, grpc.StatusCode.INTERNAL, f"decode failed: {e}"))
            finally:
                if tasks.get(rid) is asyncio.current_task():
                    del tasks[rid]
                out.put(None)  # wakes the writer: the call may be over

        def start(st: decode_pb2.DecodeManyStart) -> None:
            rid = st.request.request_id
            if rid in tasks:
                out.put(_error(rid, grpc.StatusCode.INVALID_ARGUMENT,
                               f"request {rid!r} is already running on this call"))
                return
            def emit(msg, rid=rid) -> None:  # built into the writer's batch (_batch)
                out.put((rid, msg))

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
            out.put(None)

        reader = loop.create_task(read())
        try:
            while True:
                batch = _batch(await out.take())
                if batch is not None:
                    yield batch
                if reader.done() and not tasks:
                    reader.result()  # a broken request stream ends the call with its error
                    return
        finally:
            reader.cancel()
            for t in list(tasks.values()):
                t.cancel()


def _batch(entries: list) -> decode_pb2.DecodeManyBatch | None:
    """The writer's message: None wake-ups dropped, one item per request (its messages that
    queued while the writer waited on a slow reader merged, in order; an error ends its
    request). An entry is a DecodeManyItem (an error, or a message the Decode handler yielded)
    or (request id, message) from emit, the message a DecodeResponse or `response`'s arguments;
    a plain step's are written into the batch in place (no message built and copied twice)."""
    batch = decode_pb2.DecodeManyBatch()
    add = batch.items.add
    last: dict[str, decode_pb2.DecodeManyItem] = {}
    for e in entries:
        if e is None:
            continue
        if type(e) is tuple:
            rid, msg = e
            fields = msg if type(msg) is tuple else None
            plain = fields is not None and is_plain(fields)
            prev = last.get(rid)
            if prev is not None and _open(prev):
                if plain:
                    _put_plain(prev.response, fields)
                else:
                    merge_decode_response(prev.response,
                                          msg if fields is None else response(*fields))
                continue
            if plain:  # most entries: a step's token, written into the batch in place
                it = add(request_id=rid)
                _put_plain(it.response, fields)
            else:
                it = add(request_id=rid, response=msg if fields is None else response(*fields))
        else:
            rid = e.request_id
            prev = last.get(rid)
            if prev is not None and _open(prev) and not e.error_code:
                merge_decode_response(prev.response, e.response)
                continue
            batch.items.append(e)
            it = batch.items[-1]
        last[rid] = it
    return batch if len(batch.items) else None


def _put_plain(into: decode_pb2.DecodeResponse, fields: tuple) -> None:
    """Append a plain step (its tokens and count) to a message in the batch."""
    into.token_ids.extend(fields[0])
    into.num_generated = fields[6]


def _open(item: decode_pb2.DecodeManyItem) -> bool:
    """More of this request's messages may merge into item."""
    return not item.error_code and not item.response.finish_reason


def _error(rid: str, code: grpc.StatusCode, details: str) -> decode_pb2.DecodeManyItem:
    return decode_pb2.DecodeManyItem(request_id=rid, error_code=code.value[0], error_message=details)
