"""common/telemetry.py and common/metrics.py: context over gRPC metadata, span attributes,
engine-stats -> Prometheus."""
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import telemetry
from common.metrics import ServiceMetrics


@pytest.fixture(scope="module")
def spans():
    exp = InMemorySpanExporter()
    telemetry.add_span_processor(SimpleSpanProcessor(exp))
    return exp


def test_trace_context_round_trip_through_metadata(spans):
    spans.clear()
    with telemetry.span("parent", attributes={"a": 1, "skip": None}) as parent:
        md = telemetry.inject_metadata([("x-other", "1")])
        assert ("x-other", "1") in md and any(k == "traceparent" for k, _ in md)
        assert telemetry.has_trace_context(md) and not telemetry.has_trace_context([("a", "b")])
    # the receiving side (another process in real life) continues the same trace
    with telemetry.server_span("child", md, attributes=telemetry.usage_attributes(3, 5, ttft_s=0.1)):
        pass
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["child"].context.trace_id == got["parent"].context.trace_id
    assert got["child"].parent.span_id == got["parent"].context.span_id
    assert got["child"].attributes["gen_ai.usage.input_tokens"] == 3
    assert got["child"].attributes["gen_ai.usage.output_tokens"] == 5
    assert got["child"].attributes["gen_ai.response.time_to_first_chunk"] == 0.1
    assert "skip" not in got["parent"].attributes


def test_span_records_errors(spans):
    spans.clear()
    with pytest.raises(ValueError):
        with telemetry.span("boom"):
            raise ValueError("bad")
    (s,) = spans.get_finished_spans()
    assert s.status.status_code.name == "ERROR" and "bad" in s.status.description


def test_metrics_from_engine_stats_and_render():
    m = ServiceMetrics("test")
    m.update_from_engine_stats({"running": 3, "waiting": 1, "kv_usage": 0.5, "prefix_hits": 10,
                                "prefix_queries": 20, "cuda_graph_replay_total": 4})
    m.update_from_engine_stats({"prefix_hits": 15, "prefix_queries": 30, "cuda_graph_replay_total": 4,
                                "num_steps": 12, "num_overlapped_steps": 9})
    m.observe_kv_transfer("send", 1024, 0.01)
    m.admission.labels(decision="reject").inc()
    body, ctype = m.render()
    text = body.decode()
    assert "text/plain" in ctype
    for line in ("splitserve_num_requests_running 3.0", "splitserve_kv_cache_usage_ratio 0.5",
                 "splitserve_prefix_cache_hits_total 15.0", "splitserve_prefix_cache_queries_total 30.0",
                 "splitserve_cuda_graph_replays_total 4.0",
                 "splitserve_engine_steps_total 12.0", "splitserve_engine_overlapped_steps_total 9.0",
                 'splitserve_kv_transfer_bytes_total{direction="send"} 1024.0',
                 'splitserve_admission_decisions_total{decision="reject"} 1.0'):
        assert line in text, line
