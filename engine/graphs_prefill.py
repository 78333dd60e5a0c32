"""CUDA graphs for prefill and mixed (prefill chunks + decode rows) steps, by token-count bucket.

Why: on a slow host an eager prefill step is launch-bound well past 1k tokens (a 1B-shape
prefill of 128..2048 tokens costs ~12 ms of launches whatever its length), so short and medium
prompts need graphs as much as decode does.

Buckets (prefill_buckets): 16..128 in steps of 16, then 4 per power of two (160, 192, 224, 256,
320, ...), up to the limit (min(cuda_graph_max_prefill_tokens, max_num_batched_tokens)), which
is always a bucket itself. Padding a batch to its bucket costs at most ~25% more tokens above 128
tokens, where the step starts to be compute-bound: plain doubling would cost up to 2x there and
lose to eager on large models. Batches above the largest bucket run eager (counted, "tokens").

Each bucket b holds at most S_b = min(b, max_seqs) sequences (max_seqs = min(max_num_seqs,
cuda_graph_max_prefill_seqs), default 64): more sequences run eager (counted, "seqs"). The graph
records embedding -> layers -> final norm -> gather of the S_b sampled rows -> lm_head, writing
into one static logits buffer [max_seqs, vocab] shared by all prefill buckets.

Static inputs for bucket b (views of one packed device buffer, filled by ONE host->device copy
from a pinned mirror per step; see PrefillStaging):
    input_ids[:b], positions[:b]    padding tokens: id 0, position 0
    slot_mapping[:b]                padding tokens: -1, never written to the KV cache
    query_start_loc[:S_b + 1]       padding sequences repeat the batch's token count, so they
                                    own zero query rows and padding tokens belong to no sequence
    seq_lens[:S_b]                  padding sequences: 0
    block_tables[:S_b, :W]          W = blocks of max_model_len. Only the first
                                    ceil(seq_len / block_size) entries of a real row are written;
                                    the rest (and padding rows) hold stale but valid block ids and
                                    are never read (kernels read entries of positions < seq_len)
    sample_idx[:S_b]                flat row of each sampled sequence's last token; padding
                                    entries point at row 0 (a valid row); the caller keeps the
                                    first num_sampled logits rows

NOTE (attention under graphs): the Triton prefill kernel's grid is (b // BLOCK_Q + S_b, Hkv),
fixed by shapes; a program whose sequence has no query rows exits at once, and query rows
outside every sequence are never written (their garbage, NaN included, stays in padding rows:
every other op is row-wise, and the gather reads real rows only; the one cross-row reduction,
fp8 KV-scale calibration, runs on a clean batch before capture and never again).
AttentionMetadata's host values are upper bounds under a graph (max_query_len = b,
max_seq_len = W * block_size) and its host copies (seq_lens_cpu, query_start_loc_cpu) are
None: a backend may use them for sizes only as bounds (flash-attn's varlen grid), never as
exact values. Triton ignores them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol, Sequence

import numpy as np
import torch

from engine.graphs import BucketGraphs, put_tokens
from engine.layers.attention import AttentionMetadata

MIN_BUCKET = 16
FINE_UNTIL = 128  # steps of MIN_BUCKET up to here, then BUCKETS_PER_OCTAVE per power of two
BUCKETS_PER_OCTAVE = 4


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens (always included); [] when max_tokens <= 0."""
    if max_tokens <= 0:
        return []
    out = []
    x = MIN_BUCKET
    while x < max_tokens:
        out.append(x)
        if x < FINE_UNTIL:
            x += MIN_BUCKET
        else:  # x in [2^k, 2^(k+1)): step 2^k / 4
            x += (1 << (x.bit_length() - 1)) // BUCKETS_PER_OCTAVE
    out.append(max_tokens)
    return out


def plan_prefill(num_tokens: int, num_seqs: int, max_seq_len: int, buckets: Sequence[int],
                 captured, max_seqs: int, max_context: int) -> tuple[int | None, str | None]:
    """Which bucket replays this batch: (bucket, None), or (None, reason) to run eager.
    Reasons: tokens (above the largest bucket), seqs (more sequences than a graph holds),
    blocks (a context longer than the static block table), no_graph (capture failed)."""
    if num_tokens > buckets[-1]:
        return None, "tokens"
    if num_seqs > max_seqs:
        return None, "seqs"
    if max_seq_len > max_context:
        return None, "blocks"
    b = next(x for x in buckets if x >= num_tokens)
    if b not in captured:
        return None, "no_graph"
    return b, None


class _Row(Protocol):  # engine.runner.StepInput
    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: bool


@dataclass
class Staged:
    bucket: int
    num_tokens: int
    num_seqs: int
    num_sampled: int


class PrefillStaging:
    """The static inputs of every prefill graph, packed into one byte buffer on the device with a
    (pinned) host mirror of the same layout, so a step costs one host->device copy instead of
    seven copies and six fills.

    Layout: int64 input_ids[T] | positions[T] | slot_mapping[T] | sample_idx[S], then int32
    query_start_loc[S+1] | seq_lens[S] | block_tables[S, W]; every segment 64-byte aligned.
    block_tables comes last so a step uploads only up to the last row it uses.
    """

    ALIGN = 64

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        T, S, W = max_tokens, max_seqs, max_blocks
        segs = [("input_ids", torch.int64, (T,)), ("positions", torch.int64, (T,)),
                ("slot_mapping", torch.int64, (T,)), ("sample_idx", torch.int64, (S,)),
                ("query_start_loc", torch.int32, (S + 1,)), ("seq_lens", torch.int32, (S,)),
                ("block_tables", torch.int32, (S, W))]
        layout, off = {}, 0
        for name, dt, shape in segs:
            off = -(-off // self.ALIGN) * self.ALIGN
            layout[name] = (off, dt, shape)
            off += int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
        self.nbytes = off
        self.max_tokens, self.max_seqs, self.max_blocks = T, S, W
        self._bt_off = layout["block_tables"][0]
        self._row_bytes = W * 4
        pin = torch.device(device).type == "cuda"
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

        def views(buf):
            return {n: buf[o:o + int(np.prod(s)) * torch.empty((), dtype=d).element_size()]
                    .view(d).view(s) for n, (o, d, s) in layout.items()}

        # recorded after each upload, waited on before the mirror is rewritten
        self._uploaded = torch.cuda.Event() if pin else None
        self.d = SimpleNamespace(**views(self.dev))  # device tensors the graphs read
        self.h = SimpleNamespace(**{n: t.numpy() for n, t in views(self.host).items()})
        # the state captured graphs see first: an empty batch (no KV writes, no query rows)
        self.h.slot_mapping[:] = -1
        self.dev.copy_(self.host)  # blocking: the mirror is rewritten right after

    def stage(self, rows: Sequence[_Row], block_size: int, bucket: int, seqs: int) -> Staged:
        """Write a batch padded to (bucket tokens, seqs sequences) into the host mirror (after
        the previous upload has read it)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        h, bs = self.h, block_size
        s = len(rows)
        lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, s)
        starts = np.fromiter((r.start for r in rows), np.int64, s)
        ends = np.cumsum(lens)
        n = int(ends[-1]) if s else 0
        if n > bucket or s > seqs or bucket > self.max_tokens or seqs > self.max_seqs:
            raise ValueError(f"{n} tokens / {s} sequences do not fit bucket {bucket} / {seqs}")
        seq_lens = starts + lens
        nblk = -(-seq_lens // bs)
        for i, r in enumerate(rows):
            k = int(nblk[i])
            if len(r.block_ids) < k:
                raise ValueError(f"row {i}: {len(r.block_ids)} blocks for {int(seq_lens[i])} tokens")
            h.block_tables[i, :k] = r.block_ids[:k]
        h.input_ids[:n] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows),
                                      np.int64, n)
        row = np.repeat(np.arange(s), lens)  # row of each token
        pos = starts[row] + np.arange(n) - (ends - lens)[row]
        h.positions[:n] = pos
        h.slot_mapping[:n] = h.block_tables[row, pos // bs].astype(np.int64) * bs + pos % bs
        h.input_ids[n:bucket] = 0
        h.positions[n:bucket] = 0
        h.slot_mapping[n:bucket] = -1
        h.query_start_loc[0] = 0
        h.query_start_loc[1:s + 1] = ends
        h.query_start_loc[s + 1:seqs + 1] = n
        h.seq_lens[:s] = seq_lens
        h.seq_lens[s:seqs] = 0
        sampled = (ends - 1)[np.fromiter((r.sample for r in rows), bool, s)]
        k = len(sampled)
        h.sample_idx[:k] = sampled
        h.sample_idx[k:seqs] = 0
        return Staged(bucket, n, s, k)

    def upload(self, num_seqs: int) -> None:
        """Host mirror -> device, up to the end of block-table row num_seqs - 1.
        NOTE: non_blocking from pinned memory: the host must not rewrite the mirror before
        this copy ran on the device: stage() waits on the event recorded here."""
        k = self._bt_off + num_seqs * self._row_bytes
        self.dev[:k].copy_(self.host[:k], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


class PrefillGraphRunner(BucketGraphs):
    kind = "prefill"
    FALLBACK_REASONS = ("tokens", "seqs", "blocks", "no_graph")

    def __init__(self, model, kv_caches, kv_scales, max_tokens: int, max_seqs: int,
                 max_blocks_per_seq: int, block_size: int, vocab_size: int,
                 device: torch.device, pool=None):
        super().__init__(prefill_buckets(max_tokens), device, pool)
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks_per_seq
        self.staging = PrefillStaging(self.buckets[-1], max_seqs, max_blocks_per_seq, self.device)
        self.logits = torch.zeros((max_seqs, vocab_size), dtype=torch.float32, device=self.device)
        self.last: Staged | None = None

    def seqs_for(self, bucket: int) -> int:
        # a sequence has >= 1 query token, so a bucket of b tokens never holds more than b
        return min(bucket, self.max_seqs)

    def static_bytes(self) -> int:
        return self.staging.nbytes + self.logits.numel() * self.logits.element_size()

    def meta(self, b: int) -> AttentionMetadata:
        d, S = self.staging.d, self.seqs_for(b)
        return AttentionMetadata(
            slot_mapping=d.slot_mapping[:b], block_tables=d.block_tables[:S],
            seq_lens=d.seq_lens[:S], query_start_loc=d.query_start_loc[:S + 1],
            max_query_len=b, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size, is_decode_only=False)

    def forward_static(self, b: int) -> None:
        """Eager run of exactly what the bucket-b graph records (tests compare the two)."""
        d, S = self.staging.d, self.seqs_for(b)
        hidden = self.model(d.input_ids[:b], d.positions[:b], self.kv_caches, self.meta(b),
                            self.kv_scales)
        self.logits[:S].copy_(self.model.compute_logits(hidden.index_select(0, d.sample_idx[:S])))

    def _forward(self, b: int) -> None:
        self.forward_static(b)

    def plan(self, rows: Sequence[_Row]) -> tuple[int | None, str | None]:
        n = sum(len(r.token_ids) for r in rows)
        longest = max((r.start + len(r.token_ids) for r in rows), default=0)
        return plan_prefill(n, len(rows), longest, self.buckets, self.graphs, self.max_seqs,
                            self.max_blocks * self.block_size)

    def stage(self, rows: Sequence[_Row], bucket: int) -> Staged:
        """Fill the static inputs for `rows` padded to `bucket` (host mirror, then upload)."""
        st = self.staging.stage(rows, self.block_size, bucket, self.seqs_for(bucket))
        self.staging.upload(st.num_seqs)
        self.last = st
        return st

    def run(self, rows: Sequence[_Row], token_src: torch.Tensor | None = None,
            token_pos: list[int] | None = None) -> torch.Tensor | None:
        """Replay for a prefill / mixed batch: logits [num_sampled, vocab] of the sampled rows
        in row order, or None (caller runs eager; counted). The logits are a view of the static
        buffer: valid until the next prefill replay.
        token_src: input ids of decode rows that the previous step sampled, still on the
        device, copied over the staged ones at the flat positions token_pos (None: the
        leading ones)."""
        b, why = self.plan(rows)
        if b is None:
            self._fallback(why)
            return None
        st = self.stage(rows, b)
        if token_src is not None:
            put_tokens(self.staging.d.input_ids, token_src, token_pos)
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[:st.num_sampled]
