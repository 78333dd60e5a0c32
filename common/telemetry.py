"""OpenTelemetry tracing and GenAI metrics for the three services, configured by environment.

    OTEL_TRACES_EXPORTER         otlp | console | none   (default here: none -> quiet, no-op spans)
    OTEL_EXPORTER_OTLP_ENDPOINT  e.g. http://127.0.0.1:4317 (OTLP/gRPC; the SDK reads it itself)
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  wins over the above for traces
    OTEL_METRICS_EXPORTER        otlp | console | none   (default none): gen_ai.server.* histograms
    OTEL_SERVICE_NAME            wins over the service name passed to setup_tracing()
    OTEL_SDK_DISABLED=true       no tracing at all
    OTEL_BSP_SCHEDULE_DELAY      batch export delay in ms (tests set it low)
    SPLITSERVE_TRACE_FILE        also append spans to this OTLP/JSON-lines file (`splitserve trace`)

With an exporter on, the gRPC servers and channels are instrumented by
opentelemetry-instrumentation-grpc: standard `rpc.*` spans, and W3C trace context in the
metadata of every call, so one request is one trace across gateway, prefill and decode. Our
own spans (admission, reserve, prefill, KV handoff, decode) nest under those rpc spans; the
gateway's request span follows the GenAI conventions (common/trace_genai.py).

Tests: `add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))` in-process, or
`tests.e2e.otlp_receiver.OTLPTraceReceiver` across processes.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterable, Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.envs import env_str
from common.trace_export import otel_env
from common.trace_genai import GenAI, request_attributes, server_endpoint, span_name, usage_attributes

__all__ = ["GenAI", "request_attributes", "server_endpoint", "span_name", "usage_attributes",
           "setup_tracing", "span", "server_span", "set_attrs", "inject_metadata", "extract_context"]

log = logging.getLogger("splitserve.telemetry")

_provider = None  # the TracerProvider this module installed (None -> API no-op provider)
_meter_provider = None


class KV:
    """splitserve-specific attributes on the KV transfer / scheduling spans."""
    REQUEST_ID = "splitserve.request_id"
    BYTES = "splitserve.kv.bytes"
    BLOCKS = "splitserve.kv.blocks"
    LAYERS = "splitserve.kv.layers"
    BACKEND = "splitserve.kv.backend"
    REPLICA = "splitserve.replica"
    ADMISSION = "splitserve.admission.decision"


def _setup_metrics(service_name: str):
    global _meter_provider
    from common.trace_export import meter_provider_from_env

    _meter_provider = meter_provider_from_env(otel_env("OTEL_SERVICE_NAME") or service_name)
    return _meter_provider


def setup_tracing(service_name: str, *, force: bool = False, trace_file: str | None = None):
    """Install a global TracerProvider (and MeterProvider) according to OTEL_* and
    SPLITSERVE_TRACE_FILE (idempotent; returns the TracerProvider or None).

    Nothing configured -> no provider: spans are no-ops and gRPC is not instrumented."""
    global _provider
    if _provider is not None and not force:
        return _provider
    if otel_env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    from common.trace_export import list_env, otlp_span_exporter

    exporters = list_env("OTEL_TRACES_EXPORTER")
    trace_file = trace_file or env_str("SPLITSERVE_TRACE_FILE")
    meter_provider = _setup_metrics(service_name)
    if not exporters and not trace_file and meter_provider is None:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = otel_env("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for e in exporters:
        if e == "otlp":
            provider.add_span_processor(BatchSpanProcessor(otlp_span_exporter()))
        elif e == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={e!r} is not supported; use otlp, console or none")
    if trace_file:
        from common.trace_otlp import file_span_exporter

        provider.add_span_processor(BatchSpanProcessor(file_span_exporter(trace_file)))
    if meter_provider is not None:
        from common.trace_genai import GenAIMetricsProcessor

        provider.add_span_processor(GenAIMetricsProcessor(meter_provider.get_meter("splitserve")))
    _set_provider(provider)
    if exporters or trace_file:  # metrics alone need only the gateway's GenAI span
        from common.trace_grpc import instrument_grpc

        instrument_grpc(provider)
    log.info("tracing: service=%s exporters=%s%s metrics=%s", name, exporters or ["none"],
             f" file={trace_file}" if trace_file else "", list_env("OTEL_METRICS_EXPORTER") or "none")
    return provider


def _set_provider(provider) -> None:
    global _provider
    _provider = provider
    # NOTE: the API refuses to replace a provider once set; tests that force a new one in the
    # same process reach the proxy's delegate instead.
    if trace._TRACER_PROVIDER is None:  # noqa: SLF001
        trace.set_tracer_provider(provider)
    else:
        trace._TRACER_PROVIDER = provider  # noqa: SLF001


def add_span_processor(processor, service_name: str = "test"):
    """Attach a span processor (e.g. SimpleSpanProcessor(InMemorySpanExporter())) for tests.
    Installs an SDK provider first if none was configured."""
    global _provider
    if _provider is None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider

        _set_provider(TracerProvider(resource=Resource.create({SERVICE_NAME: service_name})))
    _provider.add_span_processor(processor)
    return _provider


def shutdown_tracing() -> None:
    """Flush and stop exporters (call on service shutdown so the last spans are not lost)."""
    if _meter_provider is not None:
        try:
            _meter_provider.shutdown()
        except Exception:  # pragma: no cover - exporter already gone
            log.debug("metrics shutdown failed", exc_info=True)
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception:  # pragma: no cover - exporter already gone
            log.debug("tracing shutdown failed", exc_info=True)


def force_flush(timeout_ms: int = 3000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def get_tracer(name: str = "splitserve"):
    return trace.get_tracer(name)


# ---- W3C trace context by hand: REST headers, and gRPC where no instrumentation runs ------

def _pairs(carrier) -> Iterable[tuple[str, str]]:
    if carrier is None:
        return ()
    if hasattr(carrier, "items"):
        return carrier.items()
    # grpc.aio gives a tuple of _Metadatum(key, value); plain tuples also work
    return ((m[0], m[1]) for m in carrier)


def inject_metadata(metadata: Sequence[tuple[str, str]] | None = None, ctx=None) -> tuple:
    """-> metadata tuple with `traceparent` (+ `tracestate`) of the current (or given) span.
    Instrumented channels inject it themselves (and replace this one)."""
    carrier: dict = {}
    propagate.inject(carrier, context=ctx)
    return (*(metadata or ()), *carrier.items())


def extract_context(metadata) -> otel_context.Context:
    """Context carried by HTTP headers, gRPC metadata (context.invocation_metadata()) or a dict."""
    return propagate.extract({str(k).lower(): v for k, v in _pairs(metadata)})


def has_trace_context(metadata) -> bool:
    """Whether gRPC metadata / headers carry a W3C traceparent."""
    return metadata is not None and any(str(k).lower() == "traceparent" for k, _ in _pairs(metadata))


def current_trace_id() -> str | None:
    sc = trace.get_current_span().get_span_context()
    return f"{sc.trace_id:032x}" if sc.is_valid else None


# ---- spans ----------------------------------------------------------------------------------

@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: dict | None = None,
         context: otel_context.Context | None = None, tracer_name: str = "splitserve",
         start_time: int | None = None) -> Iterator:
    """Current-span context manager; an exception marks the span ERROR and is re-raised.
    asyncio.CancelledError is recorded as a cancelled request, not an error."""
    import asyncio

    tracer = trace.get_tracer(tracer_name)
    with tracer.start_as_current_span(name, context=context, kind=kind,
                                      attributes=_clean(attributes), start_time=start_time,
                                      record_exception=False, set_status_on_exception=False) as sp:
        try:
            yield sp
        except asyncio.CancelledError:
            sp.set_attribute("splitserve.cancelled", True)
            raise
        except BaseException as e:
            sp.record_exception(e)
            sp.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            sp.set_attribute(GenAI.ERROR_TYPE, error_type(e))
            raise


def error_type(e: BaseException) -> str:
    """error.type: the gRPC status name (RESOURCE_EXHAUSTED, ...) where the error carries one,
    else the exception's class name."""
    code = getattr(e, "code", None)
    if callable(code):  # grpc.RpcError / AioRpcError
        try:
            code = code()
        except Exception:  # noqa: BLE001 - not a gRPC error after all
            code = None
    name = getattr(code, "name", None)
    return name if isinstance(name, str) and name else type(e).__qualname__


@contextlib.contextmanager
def server_span(name: str, metadata, *, attributes: dict | None = None) -> Iterator:
    """The handler's span: a child of the gRPC instrumentation's rpc SERVER span when that is
    current (tracing on), else a SERVER span continuing the trace in the call's metadata (or
    in the servicer context it came with: context.invocation_metadata())."""
    cur = trace.get_current_span().get_span_context()
    if cur.is_valid and not cur.is_remote:
        with span(name, attributes=attributes) as sp:
            yield sp
        return
    if hasattr(metadata, "invocation_metadata"):
        metadata = metadata.invocation_metadata() or ()
    with span(name, kind=SpanKind.SERVER, attributes=attributes,
              context=extract_context(metadata)) as sp:
        yield sp


@contextlib.contextmanager
def request_span(operation: str, model: str, params, request_id: str, metadata=None,
                 arrival: float | None = None) -> Iterator:
    """The gateway's GenAI span of one request, `{operation} {model}`, from its arrival
    (time.monotonic()) on: INTERNAL under a current server span (the gRPC instrumentation's or
    the HTTP server's); else a SERVER span continuing the traceparent in metadata."""
    cur = trace.get_current_span().get_span_context()
    nested = cur.is_valid and not cur.is_remote
    ctx = extract_context(metadata) if not nested and has_trace_context(metadata) else None
    attrs = {**request_attributes(model, params, operation, request_id), **server_endpoint(metadata)}
    start = None if arrival is None else time.time_ns() - int((time.monotonic() - arrival) * 1e9)
    with span(span_name(operation, model), kind=SpanKind.INTERNAL if nested else SpanKind.SERVER,
              context=ctx, attributes=attrs, start_time=start) as sp:
        yield sp


def set_attrs(sp, attributes: dict | None) -> None:
    """Set attributes, skipping None values (OTel rejects them)."""
    for k, v in _clean(attributes).items():
        sp.set_attribute(k, v)


def _clean(attributes: dict | None) -> dict:
    out = {}
    for k, v in (attributes or {}).items():
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            v = [str(x) if not isinstance(x, (bool, int, float, str)) else x for x in v]
        elif not isinstance(v, (bool, int, float, str)):
            v = str(v)
        out[k] = v
    return out
