"""CUDA-graph capture and replay of whole decode steps, by batch-size bucket.

One graph per bucket (1, 2, 4, 8, then steps of 16 up to max_num_seqs), captured largest
first into the runner's shared memory pool (engine/graphs.py). Each graph runs embedding ->
all layers (KV write + paged attention) -> final norm -> lm_head for `bucket` rows whose inputs
sit in static buffers. A batch is padded to the next bucket: padding rows write nowhere
(slot -1) and attend to nothing (seq_len 0; `run` with device tensors: one token of block 0),
and their logits are dropped.

NOTE: graph replay needs a graph-safe attention backend (no host syncs, grids fixed by
tensor shapes): the Triton and flash-attn backends are; the torch reference is not, so the
runner never builds graph runners for it.
"""
from __future__ import annotations

import torch

from engine.graphs import BucketGraphs, put_tokens
from engine.graphs_prefill import PrefillStaging
from engine.layers.attention import AttentionMetadata


def decode_buckets(max_batch: int) -> list[int]:
    b = [x for x in (1, 2, 4, 8) if x <= max_batch]
    x = 16
    while x <= max_batch:
        b.append(x)
        x += 16
    if b[-1] != max_batch:
        b.append(max_batch)
    return b


class DecodeGraphRunner(BucketGraphs):
    kind = "decode"
    # batch: more rows than the largest bucket; blocks: a block table wider than the static
    # one; no_graph: that bucket's capture failed
    FALLBACK_REASONS = ("batch", "blocks", "no_graph")

    def __init__(self, model, kv_caches, kv_scales, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, pool=None):
        super().__init__(decode_buckets(max_batch), device, pool)
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        B = self.buckets[-1]
        # NOTE: the static inputs live in one packed device buffer with a pinned host mirror
        # (the prefill graphs' layout): a step from runner rows costs host numpy + ONE upload
        # instead of per-tensor H2D copies, copies into static buffers and padding fills.
        self.staging = PrefillStaging(B, B, max_blocks_per_seq, self.device)
        d = self.staging.d
        self.input_ids, self.positions, self.slot_mapping = d.input_ids, d.positions, d.slot_mapping
        self.block_tables, self.seq_lens, self.query_start_loc = d.block_tables, d.seq_lens, d.query_start_loc
        # each graph also writes its rows' greedy tokens (argmax of the logits) here: a greedy
        # batch needs no sampler launches after the replay (Sampler.greedy_only)
        self.greedy = torch.zeros(B, dtype=torch.int64, device=self.device)

    def static_bytes(self) -> int:
        return self.staging.nbytes + self.greedy.numel() * self.greedy.element_size()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size, is_decode_only=True)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches,
                            self._meta(b), self.kv_scales)
        logits = self.model.compute_logits(hidden)
        torch.argmax(logits, dim=-1, out=self.greedy[:b])
        return logits

    def greedy_tokens(self, n: int) -> torch.Tensor:
        """The last replay's greedy tokens of its first n rows (a view: valid until the next
        replay), equal to the sampler's argmax of the same logits."""
        return self.greedy[:n]

    def _bucket(self, n: int, nblk: int) -> int | None:
        """The captured bucket for n rows whose block tables need nblk columns, else None
        (the reason counted)."""
        b = self.bucket_for(n)
        if b is None:
            self._fallback("batch")
        elif nblk > self.max_blocks:
            self._fallback("blocks")
        elif b not in self.graphs:
            self._fallback("no_graph")
        else:
            return b
        return None

    def run_rows(self, rows, token_src: torch.Tensor | None = None,
                 token_pos: list[int] | None = None) -> torch.Tensor | None:
        """Replay for decode rows (runner StepInputs: one token each, all sampled) staged
        straight from the host; returns logits [n, vocab] or None (caller runs eager; counted).
        The logits are a view of the bucket's output: valid until the next replay.
        token_src: input token ids as a device tensor (the previous step's sampled tokens,
        not yet on the host) copied over the staged ones on the device, at the rows token_pos
        (None: the leading ones)."""
        n = len(rows)
        longest = max(r.start + len(r.token_ids) for r in rows)
        b = self._bucket(n, -(-longest // self.block_size))
        if b is None:
            return None
        self.staging.stage(rows, self.block_size, b, b)  # padding: slot -1, seq_len 0
        self.staging.upload(b)
        if token_src is not None:
            put_tokens(self.input_ids, token_src, token_pos)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:n]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor | None:
        """Replay for a decode-only batch given as device tensors; returns logits [n, vocab] or
        None (caller runs eager; counted). The logits are a view of the bucket's output."""
        n = input_ids.shape[0]
        nblk = meta.block_tables.shape[1]
        b = self._bucket(n, nblk)
        if b is None:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        self.query_start_loc[n + 1:b + 1].fill_(n)
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


# the name the runner, tests and benchmarks have always used
CUDAGraphRunner = DecodeGraphRunner
