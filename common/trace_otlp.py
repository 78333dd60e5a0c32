"""OTLP/JSON trace files: the services' file exporter, a local OTLP/gRPC receiver that writes
the same format, and the reader `splitserve trace` uses.

Format: one ExportTraceServiceRequest per line in the OTLP/JSON encoding (lowerCamelCase keys,
hex trace / span ids, integer enums), as the OpenTelemetry Collector's file exporter writes;
such a Collector file is read too.
"""
from __future__ import annotations

import base64
import json
import os
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from google.protobuf.json_format import MessageToDict

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


@dataclass
class Span:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # "" for a root span
    kind: int  # OTLP SpanKind: 1 internal, 2 server, 3 client
    attributes: dict = field(default_factory=dict)
    status_code: int = 0  # 2 = error
    start_ns: int = 0
    end_ns: int = 0

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


# ---- writing ----------------------------------------------------------------------------------

def _hex_ids(obj) -> None:
    """MessageToDict writes bytes as base64; OTLP/JSON wants trace / span ids in hex."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _ID_KEYS and isinstance(v, str):
                obj[k] = base64.b64decode(v).hex()
            else:
                _hex_ids(v)
    elif isinstance(obj, list):
        for v in obj:
            _hex_ids(v)


def request_to_json(req) -> str:
    """An ExportTraceServiceRequest as one OTLP/JSON line (no newline)."""
    d = MessageToDict(req, use_integers_for_enums=True)
    _hex_ids(d)
    return json.dumps(d, separators=(",", ":"))


class JsonLinesWriter:
    """Appends lines to a file; each line is one write() on an O_APPEND descriptor, so several
    processes may share one file without interleaving lines (local filesystems)."""

    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._lock:
            os.write(self._fd, data)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def file_span_exporter(path: str):
    """A SpanExporter appending OTLP/JSON lines to path (use with a BatchSpanProcessor)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class FileSpanExporter(SpanExporter):
        def __init__(self):
            self.writer = JsonLinesWriter(path)

        def export(self, spans):
            try:
                self.writer.write(request_to_json(encode_spans(spans)))
            except OSError:
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

        def shutdown(self):
            self.writer.close()

    return FileSpanExporter()


# ---- reading ----------------------------------------------------------------------------------

def _value(v: dict):
    for k, x in v.items():
        if k == "arrayValue":
            return [_value(e) for e in x.get("values", [])]
        if k == "intValue":
            return int(x)
        if k == "doubleValue":
            return float(x)
        if k == "kvlistValue":
            return {e["key"]: _value(e.get("value", {})) for e in x.get("values", [])}
        return x
    return None


def _id(v: str | None, nbytes: int) -> str:
    if not v:
        return ""
    if len(v) == 2 * nbytes:
        return v.lower()
    return base64.b64decode(v).hex()  # a base64 writer (proto3 JSON of bytes)


def spans_from_json(d: dict) -> list[Span]:
    out = []
    for rs in d.get("resourceSpans", []):
        res = {a["key"]: _value(a.get("value", {})) for a in rs.get("resource", {}).get("attributes", [])}
        service = str(res.get("service.name", ""))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                out.append(Span(
                    service=service, name=s.get("name", ""), trace_id=_id(s.get("traceId"), 16),
                    span_id=_id(s.get("spanId"), 8), parent_span_id=_id(s.get("parentSpanId"), 8),
                    kind=int(s.get("kind", 0)),
                    attributes={a["key"]: _value(a.get("value", {})) for a in s.get("attributes", [])},
                    status_code=int(s.get("status", {}).get("code", 0)),
                    start_ns=int(s.get("startTimeUnixNano", 0)), end_ns=int(s.get("endTimeUnixNano", 0))))
    return out


def read_spans(paths: Sequence[str]) -> list[Span]:
    """Spans from OTLP/JSON files (one request per line, or one JSON document per file)."""
    out: list[Span] = []
    for p in paths:
        with open(p) as f:
            text = f.read()
        try:
            docs: Iterable[dict] = [json.loads(text)]
        except json.JSONDecodeError:
            docs = (json.loads(line) for line in text.splitlines() if line.strip())
        for d in docs:
            out.extend(spans_from_json(d))
    return out


# ---- receiving --------------------------------------------------------------------------------

def serve_receiver(on_request: Callable[[object], None], host: str = "127.0.0.1", port: int = 4317):
    """Start an OTLP/gRPC trace receiver calling on_request(ExportTraceServiceRequest) for each
    export; -> (grpc.Server, bound port). Stop it with server.stop(None)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (gRPC name)
            on_request(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the OTLP receiver to {host}:{port}")
    server.start()
    return server, bound
