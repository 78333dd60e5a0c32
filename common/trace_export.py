"""Exporters chosen by the standard OTEL_* variables (common/telemetry.py installs them).

    OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER   otlp | console | none (comma-separated)
    OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT  http://host:4317 (an http:// endpoint
                                                   means plaintext gRPC, the usual local setup)
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL           grpc (default) | http/protobuf
"""
from __future__ import annotations

import os


def otel_env(name: str, default: str = "") -> str:
    """A standard OTEL_* (or other non-SPLITSERVE_) variable, stripped."""
    return os.environ.get(name, default).strip()


def list_env(name: str) -> list[str]:
    """The exporters named in a comma-separated variable, `none` left out."""
    return [e for e in (x.strip().lower() for x in otel_env(name, "none").split(",")) if e and e != "none"]


def otlp_span_exporter():
    proto = (otel_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or otel_env("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "grpc").lower()
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = otel_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or otel_env("OTEL_EXPORTER_OTLP_ENDPOINT")
        insecure = endpoint.startswith("http://") if endpoint else True
        return OTLPSpanExporter(endpoint=endpoint or None, insecure=insecure)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExp
    except ImportError as e:  # pragma: no cover - package not installed here
        raise ValueError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs "
                         "opentelemetry-exporter-otlp-proto-http; use grpc") from e
    return HTTPExp()


def meter_provider_from_env(service_name: str):
    """A global MeterProvider exporting per OTEL_METRICS_EXPORTER, or None when none/unset."""
    exporters = list_env("OTEL_METRICS_EXPORTER")
    if not exporters:
        return None
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    readers = []
    for e in exporters:
        if e == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            endpoint = otel_env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or otel_env("OTEL_EXPORTER_OTLP_ENDPOINT")
            exp = OTLPMetricExporter(endpoint=endpoint or None,
                                     insecure=endpoint.startswith("http://") if endpoint else True)
        elif e == "console":
            exp = ConsoleMetricExporter()
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER={e!r} is not supported; use otlp, console or none")
        readers.append(PeriodicExportingMetricReader(exp))
    provider = MeterProvider(metric_readers=readers, resource=Resource.create({SERVICE_NAME: service_name}))
    metrics.set_meter_provider(provider)
    return provider
