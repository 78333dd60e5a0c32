"""OpenTelemetry GenAI semantic conventions: the attribute names our spans carry, and the
`gen_ai.server.*` histograms derived from finished GenAI spans.

The gateway's request span is named `{gen_ai.operation.name} {gen_ai.request.model}` (e.g.
`chat SmolLM2-135M-Instruct`). Latencies the conventions do not name live under `splitserve.*`.

GenAIMetricsProcessor turns each finished GenAI span into the conventions' server metrics
(as the Collector's spanmetrics connector would), so the request path records one set of
numbers and both signals agree.
"""
from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

PROVIDER_NAME = "splitserve"


class GenAI:
    """Attribute names of the OpenTelemetry GenAI conventions (plus general ones they use)."""
    PROVIDER = "gen_ai.provider.name"
    OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TOP_K = "gen_ai.request.top_k"
    REQUEST_SEED = "gen_ai.request.seed"
    REQUEST_STOP = "gen_ai.request.stop_sequences"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"  # seconds
    TTFT = TIME_TO_FIRST_CHUNK  # the first chunk carries the first token
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    USAGE_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
    ERROR_TYPE = "error.type"
    SERVER_ADDRESS = "server.address"
    SERVER_PORT = "server.port"
    # not in the conventions: splitserve's own
    TPOT = "splitserve.latency.time_per_output_token"  # seconds
    E2E = "splitserve.latency.e2e"  # seconds
    REQUEST_ID = "splitserve.request_id"


# gen_ai.server.* metric names and the conventions' advised bucket boundaries (seconds)
TTFT_METRIC = "gen_ai.server.time_to_first_token"
TPOT_METRIC = "gen_ai.server.time_per_output_token"
DURATION_METRIC = "gen_ai.server.request.duration"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
# attributes copied from the span onto every metric point (low cardinality only)
METRIC_ATTRS = (GenAI.OPERATION, GenAI.PROVIDER, GenAI.REQUEST_MODEL, GenAI.RESPONSE_MODEL,
                GenAI.ERROR_TYPE, GenAI.SERVER_ADDRESS, GenAI.SERVER_PORT)


def span_name(operation: str, model: str) -> str:
    return f"{operation} {model}"


def request_attributes(model: str, params, operation: str = "text_completion",
                       request_id: str | None = None) -> dict:
    """GenAI request attributes from a SamplingParams-like object; unset knobs are left out
    (top_k <= 0 means disabled, so it is not recorded)."""
    top_k = getattr(params, "top_k", None)
    stop = getattr(params, "stop", None)
    return {GenAI.PROVIDER: PROVIDER_NAME, GenAI.OPERATION: operation, GenAI.REQUEST_MODEL: model,
            GenAI.REQUEST_MAX_TOKENS: getattr(params, "max_tokens", None),
            GenAI.REQUEST_TEMPERATURE: getattr(params, "temperature", None),
            GenAI.REQUEST_TOP_P: getattr(params, "top_p", None),
            GenAI.REQUEST_TOP_K: top_k if isinstance(top_k, int) and top_k > 0 else None,
            GenAI.REQUEST_SEED: getattr(params, "seed", None),
            GenAI.REQUEST_STOP: list(stop) if stop else None,
            GenAI.RESPONSE_ID: request_id, GenAI.REQUEST_ID: request_id,
            GenAI.RESPONSE_MODEL: model}  # one served model: the response's is the request's


def usage_attributes(prompt_tokens: int, completion_tokens: int, *, cached_tokens: int | None = None,
                     ttft_s: float | None = None, tpot_s: float | None = None,
                     e2e_s: float | None = None, finish_reason: str | None = None,
                     response_model: str | None = None) -> dict:
    return {GenAI.USAGE_INPUT_TOKENS: prompt_tokens, GenAI.USAGE_OUTPUT_TOKENS: completion_tokens,
            GenAI.USAGE_CACHE_READ: cached_tokens, GenAI.TIME_TO_FIRST_CHUNK: ttft_s,
            GenAI.TPOT: tpot_s, GenAI.E2E: e2e_s, GenAI.RESPONSE_MODEL: response_model,
            GenAI.RESPONSE_FINISH_REASONS: [finish_reason] if finish_reason else None}


def server_endpoint(metadata) -> dict:
    """server.address / server.port from a Host (REST) or :authority (gRPC) header, if any."""
    if metadata is None:
        return {}
    pairs = metadata.items() if hasattr(metadata, "items") else ((m[0], m[1]) for m in metadata)
    for k, v in pairs:
        if str(k).lower() in ("host", ":authority") and v:
            host, _, port = str(v).rpartition(":")
            if host and port.isdigit():
                return {GenAI.SERVER_ADDRESS: host.strip("[]"), GenAI.SERVER_PORT: int(port)}
            return {GenAI.SERVER_ADDRESS: str(v)}
    return {}


class GenAIMetricsProcessor(SpanProcessor):
    """Records gen_ai.server.{request.duration, time_to_first_token, time_per_output_token}
    from every finished span that has gen_ai.operation.name."""

    def __init__(self, meter):
        self.duration = meter.create_histogram(
            DURATION_METRIC, unit="s", description="GenAI server request duration",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS))
        self.ttft = meter.create_histogram(
            TTFT_METRIC, unit="s", description="Time to generate the first token",
            explicit_bucket_boundaries_advisory=list(TTFT_BUCKETS))
        self.tpot = meter.create_histogram(
            TPOT_METRIC, unit="s", description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=list(TPOT_BUCKETS))

    def on_end(self, span: ReadableSpan) -> None:
        a = span.attributes or {}
        if GenAI.OPERATION not in a or span.end_time is None or span.start_time is None:
            return
        labels = {k: a[k] for k in METRIC_ATTRS if k in a}
        self.duration.record((span.end_time - span.start_time) / 1e9, labels)
        if GenAI.ERROR_TYPE in a:
            return
        ttft = a.get(GenAI.TIME_TO_FIRST_CHUNK)
        if ttft is not None:
            self.ttft.record(float(ttft), labels)
        tpot = a.get(GenAI.TPOT)
        if tpot is not None:
            self.tpot.record(float(tpot), labels)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
