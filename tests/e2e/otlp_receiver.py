"""A tiny in-process OTLP/gRPC trace receiver for tests: services export spans to it
(OTEL_TRACES_EXPORTER=otlp, OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>) and the
test inspects them as plain dicts. Not a collector: keeps everything in memory."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict = field(default_factory=dict)
    status_code: int = 0
    start_ns: int = 0
    end_ns: int = 0


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: "OTLPTraceReceiver"):
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 (gRPC name)
        spans = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(res.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind, attributes={a.key: _value(a.value) for a in s.attributes},
                        status_code=s.status.code, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano))
        with self.sink._cond:
            self.sink.spans.extend(spans)
            self.sink._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPTraceReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def start(self) -> "OTLPTraceReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until predicate(spans) is true; returns the spans (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise TimeoutError(f"spans received so far: {names}")
                self._cond.wait(left)
            return list(self.spans)
