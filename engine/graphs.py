"""CUDA-graph capture and replay of whole decode steps, by batch-size bucket.

One graph per bucket (1, 2, 4, 8, then steps of 16 up to max_num_seqs), captured largest
first into one shared memory pool. Each graph runs embedding -> all layers (KV write +
paged attention) -> final norm -> lm_head for `bucket` rows whose inputs sit in static
buffers. A batch is padded to the next bucket: padding rows write nowhere (slot -1) and
attend to one token of block 0, and their logits are dropped.

NOTE: graph replay needs a graph-safe attention backend (no host syncs, grids fixed by
tensor shapes): the Triton and flash-attn backends are; the torch reference is not, so the
runner never builds a CUDAGraphRunner for it.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.layers.attention import AttentionMetadata

log = logging.getLogger("splitserve.engine.graphs")


def decode_buckets(max_batch: int) -> list[int]:
    b = [x for x in (1, 2, 4, 8) if x <= max_batch]
    x = 16
    while x <= max_batch:
        b.append(x)
        x += 16
    if b[-1] != max_batch:
        b.append(max_batch)
    return b


class CUDAGraphRunner:
    def __init__(self, model, kv_caches, kv_scales, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.device = device
        self.buckets = decode_buckets(max_batch)
        self.max_blocks = max_blocks_per_seq
        B = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((B, max_blocks_per_seq), **i32)
        self.seq_lens = torch.ones(B, **i32)
        self.query_start_loc = torch.arange(B + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0
        self.fallbacks = 0
        self.failed = 0
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size, is_decode_only=True)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches,
                            self._meta(b), self.kv_scales)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        # Warm up every bucket outside capture, on a side stream: Triton specializes kernels
        # on argument values (e.g. divisibility by 16), and compiling inside a capture fails.
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for b in reversed(self.buckets):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        for i, b in enumerate(reversed(self.buckets)):
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._forward(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
                self.outputs[b] = out
            except Exception as e:  # noqa: BLE001 - counted, that bucket runs eager
                self.failed += 1
                log.warning("cuda graph capture failed for batch %d: %r", b, e)
            if (i + 1) % 4 == 0 or i + 1 == len(self.buckets):
                log.info("captured %d/%d decode graphs", i + 1, len(self.buckets))
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        log.info("cuda graphs: %d buckets (max %d) in %.1fs, %.1f MiB", len(self.graphs),
                 self.buckets[-1], self.capture_seconds, self.graph_memory_bytes / 2**20)

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b if b in self.graphs else None
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor | None:
        """Replay for a decode-only batch; returns logits [n, vocab] or None (caller runs eager)."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        nblk = meta.block_tables.shape[1]
        if b is None or nblk > self.max_blocks:
            self.fallbacks += 1
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :nblk].copy_(meta.block_tables)
        if nblk < self.max_blocks:
            self.block_tables[:n, nblk:].zero_()
        if n < b:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:n]

    def metrics(self) -> dict:
        return {"cuda_graph_captured_count": len(self.graphs),
                "cuda_graph_buckets": sorted(self.graphs),
                "cuda_graph_replay_total": self.replays,
                "cuda_graph_eager_fallback_total": self.fallbacks,
                "graph_replay_failed_total": self.failed,
                "cuda_graph_capture_seconds": round(self.capture_seconds, 3),
                "cuda_graph_memory_bytes": self.graph_memory_bytes}
