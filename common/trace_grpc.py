"""gRPC tracing by opentelemetry-instrumentation-grpc: standard rpc.* spans on every grpc.aio
server and channel, and W3C trace context carried in the calls' metadata.

One change to the package's client side: a server-streaming call's span ends when the call
ends, not when the caller reads the stream to its end. The gateway stops reading a Decode
stream at its finish message; with the package's wrapper that span would never end, never
be exported, and decode's side of the call would have no parent in the trace.
"""
from __future__ import annotations

import asyncio

import grpc
from opentelemetry.instrumentation.grpc import (GrpcAioInstrumentorClient, GrpcAioInstrumentorServer,
                                                filters)
from opentelemetry.instrumentation.grpc._aio_client import UnaryStreamAioClientInterceptor
from opentelemetry.trace import Status, StatusCode

# internal polls and infrastructure RPCs get no rpc spans (a trace each would bury the requests)
UNTRACED_METHODS = ("Load",)
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "grpc.reflection.v1.ServerReflection")


class _StreamEndsWithCall(UnaryStreamAioClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        if self.tracing_skipped(client_call_details):
            return await continuation(client_call_details, request)
        with self._start_interceptor_span(client_call_details.method) as span:
            call = await continuation(self.propagate_trace_in_details(client_call_details), request)
            if self._request_hook:
                self._call_request_hook(span, request)
        call.add_done_callback(lambda c: asyncio.ensure_future(_end(span, c)))
        return call


async def _end(span, call) -> None:
    try:
        code = await call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        # NOTE: CANCELLED is the caller's own choice (the gateway drops a finished stream
        # without waiting for its status), not a failure of the call
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, await call.details()))
    finally:
        span.end()


class _AioClientInstrumentor(GrpcAioInstrumentorClient):
    def _add_interceptors(self, tracer_provider, kwargs):
        kwargs = super()._add_interceptors(tracer_provider, kwargs)
        kwargs["interceptors"] = [_adopt(i) for i in kwargs["interceptors"]]
        return kwargs


def _adopt(i):
    if type(i) is UnaryStreamAioClientInterceptor:
        i.__class__ = _StreamEndsWithCall  # same state, the span ends with the call
    return i


def instrument_grpc(provider) -> None:
    """Instrument every grpc.aio server and channel created from now on (idempotent), except
    polls and health checks."""
    skip = filters.any_of(*(filters.method_name(m) for m in UNTRACED_METHODS),
                          *(filters.service_name(s) for s in UNTRACED_SERVICES))
    for inst in (GrpcAioInstrumentorServer(filter_=filters.negate(skip)),
                 _AioClientInstrumentor(filter_=filters.negate(skip))):
        if not inst.is_instrumented_by_opentelemetry:
            inst.instrument(tracer_provider=provider)
