"""OpenTelemetry tracing for the three services, configured by the standard OTEL_* variables.

    OTEL_TRACES_EXPORTER         otlp | console | none   (default here: none -> quiet, no-op spans)
    OTEL_EXPORTER_OTLP_ENDPOINT  e.g. http://127.0.0.1:4317 (OTLP/gRPC; the SDK reads it itself)
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  wins over the above for traces
    OTEL_SERVICE_NAME            wins over the service name passed to setup_tracing()
    OTEL_SDK_DISABLED=true       no tracing at all
    OTEL_BSP_SCHEDULE_DELAY      batch export delay in ms (tests set it low)

One request is one trace: the gateway injects W3C `traceparent` into the gRPC metadata of
every downstream call (`inject_metadata`), prefill/decode extract it (`extract_context` /
`server_span`). Span attributes follow the OpenTelemetry GenAI conventions (`GenAI` below).

Tests: `add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))` in-process, or
`tests.e2e.otlp_receiver.OTLPTraceReceiver` across processes.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger("splitserve.telemetry")

_provider = None  # the TracerProvider this module installed (None -> API no-op provider)


class GenAI:
    """Attribute names (OpenTelemetry semantic conventions for GenAI, plus latency extras)."""
    SYSTEM = "gen_ai.system"  # "splitserve"
    OPERATION = "gen_ai.operation.name"  # "text_completion" | "chat"
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TOP_K = "gen_ai.request.top_k"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    # both the older (prompt/completion) and newer (input/output) usage names are set
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    TTFT = "gen_ai.latency.time_to_first_token"  # seconds
    TPOT = "gen_ai.latency.time_per_output_token"  # seconds
    E2E = "gen_ai.latency.e2e"  # seconds


class KV:
    """splitserve-specific attributes on the KV transfer / scheduling spans."""
    REQUEST_ID = "splitserve.request_id"
    BYTES = "splitserve.kv.bytes"
    BLOCKS = "splitserve.kv.blocks"
    LAYERS = "splitserve.kv.layers"
    BACKEND = "splitserve.kv.backend"
    REPLICA = "splitserve.replica"
    ADMISSION = "splitserve.admission.decision"


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def setup_tracing(service_name: str, *, force: bool = False):
    """Install a global TracerProvider according to OTEL_* (idempotent; returns it or None).

    none/unset -> no provider: spans are no-ops (context still propagates, costs ~nothing).
    """
    global _provider
    if _provider is not None and not force:
        return _provider
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    exporters = [e.strip().lower() for e in _env("OTEL_TRACES_EXPORTER", "none").split(",") if e.strip()]
    exporters = [e for e in exporters if e != "none"]
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = _env("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    for e in exporters:
        if e == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        elif e == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={e!r} is not supported; use otlp, console or none")
    _set_provider(provider)
    log.info("tracing: service=%s exporters=%s", name, exporters or ["none (in-process only)"])
    return provider


def _otlp_exporter():
    proto = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "grpc").lower()
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT")
        # NOTE: an http:// endpoint means plaintext gRPC (the usual local collector / Jaeger setup)
        insecure = endpoint.startswith("http://") if endpoint else True
        return OTLPSpanExporter(endpoint=endpoint or None, insecure=insecure)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExp
    except ImportError as e:  # pragma: no cover - package not installed here
        raise ValueError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs "
                         "opentelemetry-exporter-otlp-proto-http; use grpc") from e
    return HTTPExp()


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


# ---- W3C trace context over gRPC metadata ---------------------------------------------------

class _MetadataSetter(Setter):
    def set(self, carrier: list, key: str, value: str) -> None:
        carrier.append((key.lower(), value))


class _MetadataGetter(Getter):
    def get(self, carrier, key: str):
        key = key.lower()
        vals = [v for k, v in _pairs(carrier) if k == key]
        return vals or None

    def keys(self, carrier) -> list[str]:
        return [k for k, _ in _pairs(carrier)]


def _pairs(carrier) -> Iterable[tuple[str, str]]:
    if carrier is None:
        return ()
    if isinstance(carrier, dict):
        return carrier.items()
    # grpc.aio gives a tuple of _Metadatum(key, value); plain tuples also work
    return ((m[0], m[1]) for m in carrier)


def inject_metadata(metadata: Sequence[tuple[str, str]] | None = None, ctx=None) -> tuple:
    """-> metadata tuple with `traceparent` (+ `tracestate`) of the current (or given) span."""
    out = list(metadata or ())
    propagate.inject(out, context=ctx, setter=_MetadataSetter())
    return tuple(out)


def extract_context(metadata) -> otel_context.Context:
    """Context carried by incoming gRPC metadata (context.invocation_metadata()) or a dict."""
    return propagate.extract(metadata, getter=_MetadataGetter())


def has_trace_context(metadata) -> bool:
    """Whether gRPC metadata / headers carry a W3C traceparent."""
    return metadata is not None and any(k.lower() == "traceparent" for k, _ in _pairs(metadata))


def current_trace_id() -> str | None:
    sc = trace.get_current_span().get_span_context()
    return f"{sc.trace_id:032x}" if sc.is_valid else None


# ---- spans ----------------------------------------------------------------------------------

@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: dict | None = None,
         context: otel_context.Context | None = None, tracer_name: str = "splitserve") -> Iterator:
    """Current-span context manager; an exception marks the span ERROR and is re-raised.
    asyncio.CancelledError is recorded as a cancelled request, not an error."""
    import asyncio

    tracer = trace.get_tracer(tracer_name)
    with tracer.start_as_current_span(name, context=context, kind=kind,
                                      attributes=_clean(attributes),
                                      record_exception=False, set_status_on_exception=False) as sp:
        try:
            yield sp
        except asyncio.CancelledError:
            sp.set_attribute("splitserve.cancelled", True)
            raise
        except BaseException as e:
            sp.record_exception(e)
            sp.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise


@contextlib.contextmanager
def server_span(name: str, metadata, *, attributes: dict | None = None) -> Iterator:
    """A SERVER span that continues the caller's trace from its gRPC metadata (or from the
    servicer context it came with: context.invocation_metadata())."""
    if hasattr(metadata, "invocation_metadata"):
        metadata = metadata.invocation_metadata() or ()
    with span(name, kind=SpanKind.SERVER, attributes=attributes,
              context=extract_context(metadata)) as sp:
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


def request_attributes(model: str, params, operation: str = "text_completion") -> dict:
    """GenAI request attributes from a SamplingParams-like object."""
    return {GenAI.SYSTEM: "splitserve", GenAI.OPERATION: operation, GenAI.REQUEST_MODEL: model,
            GenAI.REQUEST_MAX_TOKENS: getattr(params, "max_tokens", None),
            GenAI.REQUEST_TEMPERATURE: getattr(params, "temperature", None),
            GenAI.REQUEST_TOP_P: getattr(params, "top_p", None),
            GenAI.REQUEST_TOP_K: getattr(params, "top_k", None)}


def usage_attributes(prompt_tokens: int, completion_tokens: int, *, cached_tokens: int | None = None,
                     ttft_s: float | None = None, tpot_s: float | None = None,
                     e2e_s: float | None = None, finish_reason: str | None = None) -> dict:
    return {GenAI.USAGE_PROMPT_TOKENS: prompt_tokens, GenAI.USAGE_INPUT_TOKENS: prompt_tokens,
            GenAI.USAGE_COMPLETION_TOKENS: completion_tokens,
            GenAI.USAGE_OUTPUT_TOKENS: completion_tokens, GenAI.USAGE_CACHED_TOKENS: cached_tokens,
            GenAI.TTFT: ttft_s, GenAI.TPOT: tpot_s, GenAI.E2E: e2e_s,
            GenAI.RESPONSE_FINISH_REASONS: [finish_reason] if finish_reason else None}
