"""CUDA graphs, shared machinery: bucketed capture with warm-up and progress, counters, metrics.

Two kinds of graph runners build on `BucketGraphs`, both owned by the ModelRunner:

    engine/graphs_decode.py   DecodeGraphRunner: decode-only steps, by batch-size bucket
    engine/graphs_prefill.py  PrefillGraphRunner: prefill and mixed steps, by token-count bucket

Both capture into ONE memory pool per runner (`torch.cuda.graph_pool_handle()`), largest
activations first (prefill buckets from the largest token count down, then decode buckets from
the largest batch down), so every later capture reuses the blocks the earlier ones freed.

NOTE (hazards of a shared pool):
- graphs of one pool must never replay concurrently: every replay goes on the runner's one
  stream, in order;
- a graph's intermediates may alias another graph's; only tensors kept alive outside the
  capture (decode logits per bucket, prefill's static logits buffer) survive a later replay,
  and a replay overwrites them: callers consume a step's logits before the next step.

Counting: a step that runs a graph is a replay of its kind; a step that could have used a graph
and ran eager is a fallback of its kind, with a reason (see each runner's FALLBACK_REASONS);
a bucket whose capture failed is counted once in `capture_failed` and its batches run eager
(reason "no_graph").
"""
from __future__ import annotations

import logging
import time

import torch

from engine.h2d import h2d

log = logging.getLogger("splitserve.engine.graphs")

# NOTE: these names are exported in Engine.stats() and read by common/metrics.py; keep them.
LEGACY_TOTALS = ("cuda_graph_captured_count", "cuda_graph_replay_total",
                 "cuda_graph_eager_fallback_total", "graph_replay_failed_total")


def put_tokens(input_ids: torch.Tensor, tokens: torch.Tensor, positions: list[int] | None) -> None:
    """Copy token ids that are still on the device (an overlapped step's samples) into a
    step's input ids: at the leading positions (None) or at these flat positions."""
    if positions is None:
        input_ids[:tokens.shape[0]].copy_(tokens, non_blocking=True)
    else:
        idx = h2d(positions, torch.long, input_ids.device)
        input_ids.index_copy_(0, idx, tokens)


def _mib(n: int) -> float:
    return n / 2**20


class BucketGraphs:
    """One CUDA graph per bucket. Subclasses fill the static inputs and define `_forward(b)`,
    the eager computation a graph of bucket b records (it reads and writes static buffers only).
    """

    kind = "base"
    FALLBACK_REASONS: tuple[str, ...] = ()

    def __init__(self, buckets: list[int], device: torch.device, pool=None):
        if not buckets or buckets != sorted(set(buckets)):
            raise ValueError(f"{self.kind} buckets must be non-empty, sorted, distinct: {buckets}")
        self.buckets = buckets
        self.device = torch.device(device)
        self.pool = pool  # a graph_pool_handle shared with the other kind; None: own pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | None] = {}
        self.replays = 0
        self.fallback_counts = {r: 0 for r in self.FALLBACK_REASONS}
        self.failed = 0
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    # ---- subclass hooks ---------------------------------------------------------------
    def _forward(self, b: int) -> torch.Tensor | None:
        raise NotImplementedError

    def static_bytes(self) -> int:
        """Bytes of static buffers allocated outside the pool (counted in graph memory)."""
        return 0

    # ---- counting ---------------------------------------------------------------------
    @property
    def fallbacks(self) -> int:
        return sum(self.fallback_counts.values())

    def _fallback(self, reason: str) -> None:
        self.fallback_counts[reason] += 1

    def bucket_for(self, n: int) -> int | None:
        """Smallest bucket >= n, or None above the largest (captured or not)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    # ---- capture ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up every bucket eagerly on a side stream, then capture them largest first."""
        dev = self.device
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        order = list(reversed(self.buckets))
        # NOTE: Triton compiles (and specialises on argument values such as divisibility by 16)
        # on a kernel's first call; compiling inside a capture fails. So every bucket runs once
        # outside capture first, on a side stream like torch.cuda.graph's own warm-up advice.
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for b in order:
                self._forward(b)
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize(dev)
        log.info("%s graphs: warmed up %d buckets in %.1fs", self.kind, len(order),
                 time.perf_counter() - t0)
        every = max(1, len(order) // 4)
        for i, b in enumerate(order):
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._forward(b)
                self.graphs[b] = g
                self.outputs[b] = out
            except Exception as e:  # noqa: BLE001 - counted; that bucket's batches run eager
                self.failed += 1
                log.warning("%s graph capture failed for bucket %d: %r", self.kind, b, e)
            if (i + 1) % every == 0 or i + 1 == len(order):
                log.info("%s graphs: %d/%d buckets (down to %d) %.1fs, %.1f MiB", self.kind,
                         i + 1, len(order), b, time.perf_counter() - t0,
                         _mib(max(0, free0 - torch.cuda.mem_get_info(dev)[0])))
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = (max(0, free0 - torch.cuda.mem_get_info(dev)[0])
                                   + self.static_bytes())
        log.info("%s cuda graphs: %d/%d captured (buckets %d..%d) in %.1fs, %.1f MiB "
                 "(incl. %.1f MiB static buffers)%s", self.kind, len(self.graphs),
                 len(self.buckets), self.buckets[0], self.buckets[-1], self.capture_seconds,
                 _mib(self.graph_memory_bytes), _mib(self.static_bytes()),
                 f", {self.failed} FAILED (those run eager)" if self.failed else "")

    # ---- metrics ------------------------------------------------------------------------
    def metrics(self) -> dict:
        """This kind alone, in the same shape as graph_metrics() of several runners."""
        return graph_metrics([self])


def graph_metrics(runners) -> dict:
    """Totals under the historical names plus per-kind counters:

        cuda_graph_{kind}_captured_count, _replay_total, _eager_fallback_total,
        _capture_failed_total, _capture_seconds, _memory_bytes, _buckets,
        cuda_graph_{kind}_fallback_{reason}_total   (one per reason of that kind)

    `cuda_graph_buckets` keeps meaning the captured decode batch sizes."""
    rs = [r for r in runners if r is not None]
    if not rs:
        return {}
    m: dict = {
        "cuda_graph_captured_count": sum(len(r.graphs) for r in rs),
        "cuda_graph_replay_total": sum(r.replays for r in rs),
        "cuda_graph_eager_fallback_total": sum(r.fallbacks for r in rs),
        "graph_replay_failed_total": sum(r.failed for r in rs),
        "cuda_graph_capture_seconds": round(sum(r.capture_seconds for r in rs), 3),
        "cuda_graph_memory_bytes": sum(r.graph_memory_bytes for r in rs),
        "cuda_graph_buckets": next((sorted(r.graphs) for r in rs if r.kind == "decode"), []),
    }
    for r in rs:
        k = f"cuda_graph_{r.kind}"
        m[f"{k}_captured_count"] = len(r.graphs)
        m[f"{k}_replay_total"] = r.replays
        m[f"{k}_eager_fallback_total"] = r.fallbacks
        m[f"{k}_capture_failed_total"] = r.failed
        m[f"{k}_capture_seconds"] = round(r.capture_seconds, 3)
        m[f"{k}_memory_bytes"] = r.graph_memory_bytes
        m[f"{k}_buckets"] = sorted(r.graphs)
        for reason, n in r.fallback_counts.items():
            m[f"{k}_fallback_{reason}_total"] = n
    return m
