"""A tiny in-process OTLP/gRPC receiver for tests: services export spans (and, with
OTEL_METRICS_EXPORTER=otlp, histograms) to it (OTEL_TRACES_EXPORTER=otlp,
OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>) and the test inspects them as plain
objects. Not a collector: keeps everything in memory."""
from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from common.trace_otlp import Span, request_to_json, spans_from_json

ReceivedSpan = Span  # common/trace_otlp.py: what `splitserve trace` reads from a file


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    """Spans go through the OTLP/JSON encoding `splitserve trace` files use, and back."""

    def __init__(self, sink: "OTLPTraceReceiver"):
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 (gRPC name)
        spans = spans_from_json(json.loads(request_to_json(request)))
        with self.sink._cond:
            self.sink.spans.extend(spans)
            self.sink._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v):
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: "OTLPTraceReceiver"):
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 (gRPC name)
        got = []
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.WhichOneof("data") != "histogram":
                        continue
                    for dp in m.histogram.data_points:
                        attrs = {a.key: _value(a.value) for a in dp.attributes}
                        got.append(ReceivedPoint(m.name, m.unit, attrs, dp.count, dp.sum,
                                                 list(dp.explicit_bounds)))
        with self.sink._cond:
            self.sink.metrics.extend(got)
            self.sink._cond.notify_all()
        return metrics_service_pb2.ExportMetricsServiceResponse()


@dataclass
class ReceivedPoint:
    """One histogram data point of an OTLP metrics export (cumulative)."""
    name: str
    unit: str
    attributes: dict
    count: int
    sum: float
    bounds: list


class OTLPTraceReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.metrics: list[ReceivedPoint] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self), self._server)
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

    def wait_for(self, predicate, timeout: float = 10.0, *, metrics: bool = False) -> list:
        """Block until predicate(spans) (or predicate(metric points)) is true; returns them
        (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.metrics if metrics else self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise TimeoutError(f"spans received so far: {names}")
                self._cond.wait(left)
            return list(self.metrics if metrics else self.spans)
