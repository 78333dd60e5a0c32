"""Sampler: logits [N, V] float32 + SamplingBatch -> one token per row (+ logprobs when asked).

Order of processing (all batched on torch tensors):
  1. min_tokens: eos (unless ignore_eos) and stop_token_ids -> -inf while output < min_tokens
  1b. constrained decoding: tokens a row's grammar disallows -> -inf (engine/structured.py)
  2. penalties: repetition (HF: positive logits / p, negative * p, for tokens in prompt+output),
     then presence / frequency on output tokens (OpenAI: l -= freq * count + pres * (count > 0))
  3. greedy rows: argmax here (exactly argmax of the raw logits when 1-2 changed nothing)
  4. temperature, then top-k, top-p (minimal nucleus with mass >= p), min-p (p >= min_p * p_max)
  5. sample: argmax(probs / q), q ~ Exp(1) (the exponential race == a categorical draw).
     Seeded rows draw q from their own torch.Generator seeded by mix_seed(seed, #outputs so far),
     so a seeded request gets the same tokens whatever else is in the batch (and after a
     preemption); unseeded rows share the device's default generator.

NOTE: the API sketch keeps one stateful generator per seeded request; deriving it from
(seed, output position) is equivalent for reproducibility and needs no cleanup on finish.

Logprobs follow vLLM's default ("raw logprobs"): log_softmax of the model's logits before
penalties, bans, temperature and truncation, i.e. the model's own distribution. Each row that
asks gets (logprob of the chosen token, [(token_id, logprob)] top-N by logprob).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.h2d import h2d
from engine.layers.sampling_batch import SamplingBatch, mix_seed
from engine.structured import apply_bitmask

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "mix_seed"]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.pen_rows is None:
        return logits
    sub = logits.index_select(0, b.pen_rows)  # [P, V]
    rep = b.repetition_penalty.unsqueeze(1)
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(b.seen_mask, penalized, sub)
    sub = sub - b.frequency_penalty.unsqueeze(1) * b.output_counts
    sub = sub - b.presence_penalty.unsqueeze(1) * (b.output_counts > 0).to(sub.dtype)
    return logits.index_copy(0, b.pen_rows, sub)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and then its top-p nucleus (in sorted space)."""
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    srt, idx = logits.sort(dim=-1, descending=False)  # ascending: the head is at the end
    if top_k is not None:
        # exactly k survivors per row (ties broken by sort order)
        pos = torch.arange(V, device=logits.device).unsqueeze(0)
        srt = srt.masked_fill(pos < (V - top_k).unsqueeze(1), float("-inf"))
    if top_p is not None:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # the tail whose mass is <= 1 - p
        drop[:, -1] = False  # the top token always survives
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < thresh, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        tokens = self.tokens(raw, batch)
        return SamplerOutput(tokens.tolist(), self._logprobs(raw, tokens, batch))

    def tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled token ids [N] as a device tensor, without waiting for the device (no
        logprobs): what __call__ returns as a list."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {batch.num_rows} rows")
        if logits.shape[1] != batch.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, vocab_size is {batch.vocab_size}")
        raw = logits.float()
        x = raw
        if batch.ban_rows is not None:
            x = x.index_put((batch.ban_rows, batch.ban_tokens),
                            torch.tensor(float("-inf"), device=x.device))
        if batch.grammar_bitmask is not None:
            x = apply_bitmask(x, batch.grammar_bitmask)
        x = apply_penalties(x, batch)
        greedy_tok = x.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tok
        return torch.where(batch.greedy, greedy_tok, self._sample(x, batch))

    def _sample(self, x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        x = x / b.temperature.unsqueeze(1)
        x = apply_top_k_top_p(x, b.top_k, b.top_p)
        x = apply_min_p(x, b.min_p)
        probs = x.softmax(dim=-1)  # [N, V]; masked entries are exactly 0
        q = torch.empty_like(probs).exponential_()
        for row, seed in b.seeded:
            g = torch.Generator(device=probs.device)
            g.manual_seed(seed)
            q[row].exponential_(generator=g)
        # NOTE: q == 0 would turn 0 / 0 into nan and win argmax; clamp it away
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    @classmethod
    def _logprobs(cls, raw: torch.Tensor, tokens: torch.Tensor, b: SamplingBatch):
        return cls.logprobs_list(cls.logprobs_device(raw, tokens, b), b)

    @staticmethod
    def logprobs_device(raw: torch.Tensor, tokens: torch.Tensor, b: SamplingBatch
                        ) -> list[torch.Tensor] | None:
        """The logprobs the rows asking for them need, as device tensors (no host sync):
        [chosen [R], top values [R, k], top ids [R, k]] (k = the largest top-N asked, the top
        pair absent when k == 0), or None when no row asks. logprobs_list reads them."""
        rows = [i for i, n in enumerate(b.logprobs) if n is not None]
        if not rows:
            return None
        if len(rows) == b.num_rows:
            sel, tok = raw, tokens
        else:
            ridx = h2d(rows, torch.long, raw.device)  # NOTE: keeps the step overlapped
            sel, tok = raw.index_select(0, ridx), tokens.index_select(0, ridx)
        lp = sel.float().log_softmax(dim=-1)
        chosen = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        k = max(b.logprobs[i] for i in rows)
        return [chosen, *lp.topk(k, dim=-1)] if k > 0 else [chosen]

    @staticmethod
    def logprobs_list(dev: list[torch.Tensor] | None, b: SamplingBatch):
        """logprobs_device's tensors (on any device) -> per row: None, or (logprob of the
        chosen token, [(token_id, logprob)] top-N)."""
        out: list = [None] * b.num_rows
        if dev is None:
            return out
        rows = [i for i, n in enumerate(b.logprobs) if n is not None]
        chosen = dev[0].tolist()
        top_v, top_i = (dev[1].tolist(), dev[2].tolist()) if len(dev) > 1 else (None, None)
        for j, i in enumerate(rows):
            n = b.logprobs[i]
            top = [(top_i[j][t], top_v[j][t]) for t in range(n)] if n else []
            out[i] = (chosen[j], top)
        return out
