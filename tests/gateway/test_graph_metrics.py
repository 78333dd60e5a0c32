"""CUDA-graph counters from engine stats to Prometheus: totals under the historical names,
plus per kind (decode / prefill), fallbacks by reason, capture failures."""
from __future__ import annotations

import torch

from common.metrics import ServiceMetrics
from engine.graphs import graph_metrics
from engine.graphs_decode import DecodeGraphRunner
from engine.graphs_prefill import PrefillGraphRunner


def _runners():
    cpu = torch.device("cpu")
    d = DecodeGraphRunner(None, [], None, max_batch=8, max_blocks_per_seq=4, block_size=16,
                          device=cpu)
    p = PrefillGraphRunner(None, [], None, max_tokens=64, max_seqs=4, max_blocks_per_seq=4,
                           block_size=16, vocab_size=32, device=cpu)
    d.graphs = {b: object() for b in d.buckets}
    p.graphs = {b: object() for b in p.buckets[1:]}
    d.replays, p.replays, p.failed = 5, 3, 1
    d.fallback_counts["batch"] = 2
    p.fallback_counts.update(tokens=4, seqs=1, no_graph=2)
    d.graph_memory_bytes, p.graph_memory_bytes = 1000, 3000
    return d, p


def test_graph_metrics_totals_and_kinds():
    d, p = _runners()
    m = graph_metrics([p, d, None])
    assert m["cuda_graph_captured_count"] == len(d.buckets) + len(p.buckets) - 1
    assert m["cuda_graph_replay_total"] == 8 and m["cuda_graph_eager_fallback_total"] == 9
    assert m["graph_replay_failed_total"] == 1 and m["cuda_graph_memory_bytes"] == 4000
    assert m["cuda_graph_buckets"] == d.buckets  # decode batch sizes, as before
    assert m["cuda_graph_prefill_buckets"] == p.buckets[1:]
    assert m["cuda_graph_prefill_fallback_tokens_total"] == 4
    assert m["cuda_graph_prefill_eager_fallback_total"] == 7
    assert m["cuda_graph_decode_fallback_batch_total"] == 2
    assert m["cuda_graph_prefill_capture_failed_total"] == 1
    assert graph_metrics([None]) == {}
    assert d.metrics()["cuda_graph_captured_count"] == len(d.buckets)  # one kind alone


def test_graph_metrics_reach_prometheus():
    d, p = _runners()
    sm = ServiceMetrics("prefill")
    sm.update_from_engine_stats(graph_metrics([p, d]))
    p.replays += 2
    p.fallback_counts["seqs"] += 1
    sm.update_from_engine_stats(graph_metrics([p, d]))
    text = sm.render()[0].decode()
    for line in ("splitserve_cuda_graph_replays_total 10.0",
                 "splitserve_cuda_graph_eager_fallbacks_total 10.0",
                 f"splitserve_cuda_graphs_captured {float(len(d.graphs) + len(p.graphs))}",
                 'splitserve_cuda_graph_replays_by_kind_total{kind="prefill"} 5.0',
                 'splitserve_cuda_graph_replays_by_kind_total{kind="decode"} 5.0',
                 'splitserve_cuda_graph_eager_fallbacks_by_reason_total{kind="prefill",reason="seqs"} 2.0',
                 'splitserve_cuda_graph_eager_fallbacks_by_reason_total{kind="prefill",reason="tokens"} 4.0',
                 'splitserve_cuda_graph_eager_fallbacks_by_reason_total{kind="decode",reason="blocks"} 0.0',
                 'splitserve_cuda_graph_capture_failures_total{kind="prefill"} 1.0',
                 f'splitserve_cuda_graphs_captured_by_kind{{kind="prefill"}} {float(len(p.graphs))}',
                 "splitserve_cuda_graph_memory_bytes 4000.0"):
        assert line in text, line
