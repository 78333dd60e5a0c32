"""Prometheus metrics of gateway, prefill and decode (names and vLLM equivalents: docs/metrics.md).

Each process builds one `ServiceMetrics` (usually via `get_metrics(service, model_name)`); tests
build their own with a fresh `CollectorRegistry` so nothing leaks between them.

    m = get_metrics("decode", "SmolLM2-135M")
    m.serve(port=9102)                         # prefill/decode: /metrics on its own port
    m.update_from_engine_stats(engine.stats()) # gauges set, cumulative engine counters -> deltas
    m.ttft.observe(0.12); m.admission.labels(decision="admit").inc()

A process exports only the series of its role (`EXPORTS`); the others exist as objects but are
registered nowhere, so a shared call site costs nothing and shows no zeroed series. Every
exported sample carries `model_name` once it is set (common/metrics_export.py).
All names start with `splitserve_`; times are seconds, sizes bytes.
"""
from __future__ import annotations

import logging
import os
import re
import threading

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, start_http_server)

from common.metrics_export import EXPORTS, MULTIPROC_ENV, exposed_registry

log = logging.getLogger("splitserve.metrics")

# latency buckets (seconds): sub-ms for ITL on GPUs up to minutes for long CPU requests
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
         2.5, 5.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0)

# request lengths (tokens): one-token replies up to long-context prompts
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)  # observed / predicted

ADMISSION_DECISIONS = ("admit", "queue", "reject")

# per-kind CUDA-graph stats keys (engine/graphs.py graph_metrics)
_GRAPH_KEY = re.compile(r"^cuda_graph_([a-z]+)_(captured_count|replay_total|capture_failed_total"
                        r"|fallback_([a-z_]+)_total)$")


class ServiceMetrics:
    def __init__(self, service: str, registry: CollectorRegistry | None = None,
                 model_name: str | None = None):
        self.service = service
        self.model_name = model_name  # the served name; the model_name label of every sample
        # registry: where this role's series register (get_sample_value reads it without the
        # model_name label); exposed: what /metrics serves
        self.registry = registry if registry is not None else CollectorRegistry()
        self.exposed = exposed_registry(self.registry, lambda: self.model_name,
                                        os.environ.get(MULTIPROC_ENV) or None)
        groups = EXPORTS.get(service)

        def r(group: str):  # NOTE: registry=None: the metric works but is exported nowhere
            return self.registry if groups is None or group in groups else None

        # --- requests (gateway: the whole request; prefill / decode: their part of it)
        self.requests = Counter("splitserve_requests", "Finished requests by outcome",
                                ["outcome"], registry=r("request"))  # stop|length|abort|error|...
        self.queue_time = Histogram(
            "splitserve_request_queue_seconds", "Time a request waited before it ran (gateway: "
            "admission queue; prefill / decode: engine queue)", buckets=_SLOW, registry=r("request"))
        # multiprocess_mode: how gateway workers' values combine (common/metrics_export.py)
        self.running = Gauge("splitserve_num_requests_running", "Requests running now",
                             registry=r("request"), multiprocess_mode="livesum")
        self.waiting = Gauge("splitserve_num_requests_waiting", "Requests waiting now",
                             registry=r("request"), multiprocess_mode="livesum")
        self.restarts = Gauge("splitserve_process_restarts", "Times `splitserve up` restarted this "
                              "service after it died (SPLITSERVE_RESTARTS)", registry=r("request"),
                              multiprocess_mode="livesum")
        self.ttft = Histogram("splitserve_time_to_first_token_seconds",
                              "Time from request arrival to its first output token", buckets=_SLOW,
                              registry=r("latency"))
        self.tpot = Histogram("splitserve_time_per_output_token_seconds",
                              "Mean time between a request's output tokens after the first",
                              buckets=_FAST, registry=r("latency"))
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", buckets=_SLOW,
                             registry=r("latency"))
        self.itl = Histogram("splitserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens of one request", buckets=_FAST,
                             registry=r("itl"))
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens processed",
                                     registry=r("prompt"))
        self.request_prompt_tokens = Histogram("splitserve_request_prompt_tokens",
                                               "Prompt length of a request (tokens)",
                                               buckets=_TOKENS, registry=r("prompt"))
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated",
                                         registry=r("generation"))
        self.request_generation_tokens = Histogram(
            "splitserve_request_generation_tokens", "Tokens generated for a finished request",
            buckets=_TOKENS, registry=r("generation"))
        self.prefill_time = Histogram(
            "splitserve_request_prefill_seconds", "Time from a request's first scheduling to its "
            "first token (the prompt's forward passes)", buckets=_SLOW, registry=r("prefill"))
        self.decode_time = Histogram(
            "splitserve_request_decode_seconds", "Time from a request's first token to its last",
            buckets=_SLOW, registry=r("decode"))
        # --- scheduler / cache state (engine)
        self.waiting_tokens = Gauge("splitserve_waiting_prefill_tokens",
                                    "Prompt tokens queued and not yet computed", registry=r("engine"))
        self.kv_usage = Gauge("splitserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1)",
                              registry=r("engine"))
        self.kv_free_blocks = Gauge("splitserve_kv_cache_free_blocks", "Free KV blocks",
                                    registry=r("engine"))
        self.prefix_queries = Counter("splitserve_prefix_cache_queries",
                                      "Tokens looked up in the prefix cache", registry=r("engine"))
        self.prefix_hits = Counter("splitserve_prefix_cache_hits",
                                   "Tokens found in the prefix cache", registry=r("engine"))
        self.preemptions = Counter("splitserve_num_preemptions", "Requests preempted (their KV "
                                   "dropped, recomputed later) for lack of KV blocks",
                                   registry=r("engine"))
        # --- engine steps (overlapped decode: engine/overlap.py)
        self.engine_steps = Counter("splitserve_engine_steps", "Model steps completed",
                                    registry=r("engine"))
        self.overlapped_steps = Counter(
            "splitserve_engine_overlapped_steps",
            "Model steps launched before the previous step's tokens reached the host",
            registry=r("engine"))
        self.yield_seconds = Counter(
            "splitserve_decode_yield_seconds",
            "Time decode held its steps back for a prefill sharing its device", registry=r("engine"))
        self.yielded_steps = Counter(
            "splitserve_decode_yielded_steps",
            "Decode steps held back for a prefill sharing the device", registry=r("engine"))
        # --- KV transfer
        self.kv_transfer_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes moved",
                                         ["direction"], registry=r("kv"))  # direction: send|recv
        self.kv_transfer_seconds = Histogram("splitserve_kv_transfer_seconds",
                                             "Duration of one request's KV transfer", ["direction"],
                                             buckets=_FAST, registry=r("kv"))
        self.kv_transfer_failures = Counter("splitserve_kv_transfer_failures",
                                            "KV transfers that failed", ["direction"],
                                            registry=r("kv"))
        self.kv_transfers = Counter("splitserve_kv_transfers", "KV transfers sent, by backend",
                                    ["backend"], registry=r("kv"))  # backend: grpc|dist|nixl|vmm|shm
        self.kv_prefix_reused_blocks = Counter(
            "splitserve_kv_prefix_reused_blocks",
            "Prompt KV blocks not transferred because decode's prefix cache held them",
            registry=r("kv"))
        self.kv_prefix_reused_bytes = Counter(
            "splitserve_kv_prefix_reused_bytes",
            "KV bytes not transferred because decode's prefix cache held them", registry=r("kv"))
        self.kv_transfer_fallbacks = Counter(
            "splitserve_kv_transfer_fallbacks",
            "KV transfers sent over grpc because the pair could not use the selected backend",
            ["reason"], registry=r("kv"))  # not_accepted|no_endpoint|device_mismatch|same_gpu|...
        self.kv_ticket_wait = Histogram(
            "splitserve_kv_ticket_wait_seconds", "Prompts run before decode's ticket came "
            "(ticket_follows): first token to the ticket's arrival (0: it was there first)",
            buckets=_FAST, registry=r("kv"))
        # --- admission (gateway)
        self.admission = Counter("splitserve_admission_decisions", "Admission controller decisions",
                                 ["decision"], registry=r("gateway"))
        for d in ADMISSION_DECISIONS:
            self.admission.labels(decision=d)  # NOTE: pre-create so the series exist at 0
        self.predicted_ttft = Histogram("splitserve_predicted_ttft_seconds",
                                        "Admission controller's TTFT prediction", buckets=_SLOW,
                                        registry=r("gateway"))
        self.predicted_tpot = Histogram("splitserve_predicted_tpot_seconds",
                                        "Admission controller's TPOT prediction", buckets=_FAST,
                                        registry=r("gateway"))
        # prediction vs outcome of admitted requests (what: ttft|tpot)
        self.prediction_ratio = Histogram(
            "splitserve_admission_prediction_ratio", "Observed / predicted delay of an admitted "
            "request (1 = exact)", ["what"], buckets=_RATIO, registry=r("gateway"))
        self.prediction_mape = Gauge(
            "splitserve_admission_prediction_abs_error_ratio", "Median absolute percentage error "
            "of the recent predictions (a fraction; the worst gateway worker's)", ["what"],
            registry=r("gateway"), multiprocess_mode="livemax")
        self.prediction_correction = Gauge(
            "splitserve_admission_prediction_correction", "Calibration of the raw prediction: "
            "corrected = offset_ms + scale * raw", ["what", "term"], registry=r("gateway"),
            multiprocess_mode="livemostrecent")
        # --- prefix-aware routing (gateway; kind: prompt|predicted|cached tokens)
        self.routing_prefix_tokens = Counter(
            "splitserve_routing_prefix_tokens", "Prompt tokens routed to prefill, those the router "
            "expected the replica's prefix cache to hold, and those it held", ["kind"],
            registry=r("gateway"))
        for k in ("prompt", "predicted", "cached"):
            self.routing_prefix_tokens.labels(kind=k)
        # --- replicas as the gateway sees them (Load polls)
        self.replica_up = Gauge("splitserve_replica_up", "1 when the replica answered its last poll",
                                ["role", "replica"], registry=r("gateway"),
                                multiprocess_mode="livemostrecent")
        self.replica_kv_usage = Gauge("splitserve_replica_kv_cache_usage_ratio",
                                      "KV usage a replica reported", ["role", "replica"],
                                      registry=r("gateway"), multiprocess_mode="livemostrecent")
        self.replica_queued_tokens = Gauge("splitserve_replica_queued_tokens",
                                           "Queued (prefill) / reserved (decode) tokens a replica "
                                           "reported", ["role", "replica"], registry=r("gateway"),
                                           multiprocess_mode="livemostrecent")
        # --- CUDA graphs (engine)
        self.cuda_graph_replays = Counter("splitserve_cuda_graph_replays", "CUDA graph replays",
                                          registry=r("engine"))
        self.cuda_graph_fallbacks = Counter("splitserve_cuda_graph_eager_fallbacks",
                                            "Steps that fell back to eager instead of a graph",
                                            registry=r("engine"))
        self.cuda_graphs_captured = Gauge("splitserve_cuda_graphs_captured",
                                          "Number of captured CUDA graphs", registry=r("engine"))
        # per kind (decode: batch-size buckets, prefill: token-count buckets); the unlabelled
        # series above stay the totals
        self.cuda_graphs_captured_by_kind = Gauge(
            "splitserve_cuda_graphs_captured_by_kind", "Captured CUDA graphs by kind", ["kind"],
            registry=r("engine"))
        self.cuda_graph_replays_by_kind = Counter(
            "splitserve_cuda_graph_replays_by_kind", "CUDA graph replays by kind", ["kind"],
            registry=r("engine"))
        self.cuda_graph_fallbacks_by_reason = Counter(
            "splitserve_cuda_graph_eager_fallbacks_by_reason",
            "Steps run eager instead of a graph, by kind and reason (decode: batch|blocks|"
            "no_graph; prefill: tokens|seqs|blocks|no_graph)", ["kind", "reason"],
            registry=r("engine"))
        self.cuda_graph_capture_failures = Counter(
            "splitserve_cuda_graph_capture_failures", "CUDA graph captures that failed (those "
            "buckets run eager)", ["kind"], registry=r("engine"))
        self.cuda_graph_memory = Gauge("splitserve_cuda_graph_memory_bytes",
                                       "GPU memory held by CUDA graphs and their static buffers",
                                       registry=r("engine"))
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    # ---- helpers ------------------------------------------------------------------------
    def _sync_counter(self, key: str, counter, total) -> None:
        """Engine stats hold cumulative totals; a Prometheus counter only goes up by deltas."""
        if total is None:
            return
        with self._lock:
            last = self._last.get(key, 0.0)
            delta = float(total) - last
            if delta < 0:  # the engine restarted its count: count from the new total
                delta = float(total)
            self._last[key] = float(total)
        if delta > 0:
            counter.inc(delta)

    def update_from_engine_stats(self, stats: dict) -> None:
        """Engine.stats() -> gauges and counters (unknown / missing keys are skipped)."""
        for key, gauge in (("running", self.running), ("waiting", self.waiting),
                           ("waiting_tokens", self.waiting_tokens), ("kv_usage", self.kv_usage),
                           ("num_free_blocks", self.kv_free_blocks),
                           ("cuda_graph_captured_count", self.cuda_graphs_captured)):
            v = stats.get(key)
            if isinstance(v, (int, float)):
                gauge.set(v)
        self._sync_counter("prefix_queries", self.prefix_queries, stats.get("prefix_queries"))
        self._sync_counter("prefix_hits", self.prefix_hits, stats.get("prefix_hits"))
        self._sync_counter("num_steps", self.engine_steps, stats.get("num_steps"))
        self._sync_counter("num_preemptions", self.preemptions, stats.get("num_preemptions"))
        self._sync_counter("num_overlapped_steps", self.overlapped_steps, stats.get("num_overlapped_steps"))
        self._sync_counter("yield_s", self.yield_seconds, stats.get("yield_seconds_total"))
        self._sync_counter("yielded_steps", self.yielded_steps, stats.get("num_yielded_steps"))
        self._sync_counter("graph_replays", self.cuda_graph_replays,
                           stats.get("cuda_graph_replay_total"))
        self._sync_counter("graph_fallbacks", self.cuda_graph_fallbacks,
                           stats.get("cuda_graph_eager_fallback_total"))
        self._update_graph_kinds(stats)

    def _update_graph_kinds(self, stats: dict) -> None:
        """Per-kind graph counters from engine/graphs.py's graph_metrics() keys:
        cuda_graph_{kind}_{captured_count,replay_total,capture_failed_total} and
        cuda_graph_{kind}_fallback_{reason}_total."""
        v = stats.get("cuda_graph_memory_bytes")
        if isinstance(v, (int, float)):
            self.cuda_graph_memory.set(v)
        for key, val in stats.items():
            m = _GRAPH_KEY.match(key)
            if m is None or not isinstance(val, (int, float)):
                continue
            kind, what, reason = m.group(1), m.group(2), m.group(3)
            if what == "captured_count":
                self.cuda_graphs_captured_by_kind.labels(kind=kind).set(val)
                continue
            if what == "replay_total":
                counter = self.cuda_graph_replays_by_kind.labels(kind=kind)
            elif what == "capture_failed_total":
                counter = self.cuda_graph_capture_failures.labels(kind=kind)
            else:
                counter = self.cuda_graph_fallbacks_by_reason.labels(kind=kind, reason=reason)
            self._sync_counter(key, counter, val)  # NOTE: labels() alone makes the series exist at 0

    def observe_kv_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.labels(direction=direction).inc(nbytes)
        self.kv_transfer_seconds.labels(direction=direction).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """-> (body, content type) for a /metrics HTTP handler (e.g. in FastAPI)."""
        return generate_latest(self.exposed), CONTENT_TYPE_LATEST

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Serve /metrics on its own thread; port 0 picks a free one. Returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.exposed)
        bound = server.server_address[1]
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, bound)
        self._server = server
        return bound

    def stop_serving(self) -> None:
        srv = getattr(self, "_server", None)
        if srv is not None:
            srv.shutdown()
            srv.server_close()
            self._server = None


_per_service: dict[str, ServiceMetrics] = {}


def get_metrics(service: str, model_name: str | None = None) -> ServiceMetrics:
    """The process-wide metrics of a service (created on first use, own registry); model_name,
    when given, becomes the model_name label of its samples."""
    if service not in _per_service:
        _per_service[service] = ServiceMetrics(service)
    if model_name is not None:
        _per_service[service].model_name = model_name
    return _per_service[service]


def serve_metrics(port: int, service: str, host: str = "127.0.0.1") -> int:
    return get_metrics(service).serve(port, host)
