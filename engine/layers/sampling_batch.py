"""SamplingBatch: the per-row sampling parameters of one step, as tensors on the logits' device.

Built once per step from the requests that sample (row i <-> reqs[i]). Optional pieces are None
when no row needs them, so the common all-greedy / plain-temperature cases stay cheap.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from engine.h2d import h2d
from engine.request import Request

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step) -> a 63-bit generator seed. Row noise depends only on the
    request's seed and how many tokens it has produced, never on the batch around it."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _scatter_rows(rows: list[list[int]], P: int, V: int, dev: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """[P, V] view: float -> occurrence counts per row, bool -> presence per row.
    One flat host->device copy (array.array beats per-row torch.tensor by ~3x)."""
    flat = array.array("q")
    lens = array.array("q")
    for r in rows:
        flat.extend(r)
        lens.append(len(r))
    out = torch.zeros((P, V + 1), dtype=dtype, device=dev)
    if len(flat):
        tok = torch.frombuffer(flat, dtype=torch.int64).to(dev)
        ln = torch.frombuffer(lens, dtype=torch.int64).to(dev)
        tok = tok.masked_fill((tok < 0) | (tok >= V), V)
        row = torch.repeat_interleave(torch.arange(P, device=dev), ln, output_size=len(flat))
        idx = row * (V + 1) + tok
        flat_out = out.view(-1)
        if dtype == torch.bool:
            flat_out[idx] = True
        else:
            flat_out.index_add_(0, idx, torch.ones(len(flat), dtype=dtype, device=dev))
    return out[:, :V]


@dataclass
class SamplingBatch:
    request_ids: list[str]
    vocab_size: int
    device: torch.device
    all_greedy: bool
    greedy: torch.Tensor | None  # [N] bool; None when all_greedy
    temperature: torch.Tensor | None  # [N] float32, 1.0 on greedy rows; None when all_greedy
    top_k: torch.Tensor | None  # [N] long in [1, V]; None when no row uses top-k
    top_p: torch.Tensor | None  # [N] float32; None when no row uses top-p
    min_p: torch.Tensor | None  # [N] float32; None when no row uses min-p
    # generator seeds for seeded rows: (row, mixed seed); other rows share the device RNG
    seeded: list[tuple[int, int]]
    # penalties, only for the rows listed in pen_rows ([P] long)
    pen_rows: torch.Tensor | None
    repetition_penalty: torch.Tensor | None  # [P]
    presence_penalty: torch.Tensor | None  # [P]
    frequency_penalty: torch.Tensor | None  # [P]
    seen_mask: torch.Tensor | None  # [P, V] bool: token in prompt or output (repetition)
    output_counts: torch.Tensor | None  # [P, V] float32: occurrences in output (presence/frequency)
    # min_tokens: (rows, token ids) whose logits are set to -inf this step
    ban_rows: torch.Tensor | None
    ban_tokens: torch.Tensor | None
    logprobs: list[int | None]  # per row: None or N (chosen + top-N)
    pen_host: tuple[int, ...] = ()  # pen_rows on the host
    # constrained decoding: each row's allowed tokens, int32 [N, ceil(V/32)] bits (all ones on
    # rows without a grammar; engine/structured.py), filled on the host from the grammar states;
    # None when no row has one. grammar_host: those rows, on the host
    grammar_bitmask: torch.Tensor | None = None
    grammar_host: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def greedy_only(self) -> bool:
        """Every row takes the argmax of the raw logits (no bans, no penalties): the sampler's
        tokens are exactly logits.argmax(-1), which a decode graph computes itself."""
        return (self.all_greedy and self.ban_rows is None and self.pen_rows is None
                and self.grammar_bitmask is None)

    @property
    def step_dependent(self) -> bool:
        """Whether the batch holds state of the outputs so far (seeded rows' noise, a
        min_tokens ban still on, penalty counts): then the next step needs a new one."""
        return (bool(self.seeded) or self.ban_rows is not None or self.pen_rows is not None
                or self.grammar_bitmask is not None)

    def count_pending(self, src: list[int | None], tokens: torch.Tensor) -> None:
        """Count tokens the rows' requests produced that are still on the device (an
        overlapped step's: row i's is tokens[src[i]], none where src[i] is None;
        from_requests counted them by number through `ahead`) into the penalty state, on the
        device."""
        if self.pen_rows is None:
            return
        sel = [(src[r], j) for j, r in enumerate(self.pen_host) if src[r] is not None]
        if not sel:
            return
        dev = self.output_counts.device
        tok = tokens.index_select(0, h2d([i for i, _ in sel], torch.long, dev))
        pen = h2d([j for _, j in sel], torch.long, dev)
        self.output_counts.index_put_((pen, tok), torch.ones(len(sel), device=dev), accumulate=True)
        self.seen_mask.index_put_((pen, tok), torch.ones(len(sel), dtype=torch.bool, device=dev))

    @staticmethod
    def from_requests(reqs: list[Request], vocab_size: int, device,
                      ahead: list[int] | None = None) -> "SamplingBatch":
        """ahead: per row, tokens the request has produced that are not among its
        output_token_ids yet (an overlapped step's, still on the device: engine/overlap.py);
        they count for seeds and min_tokens."""
        if not reqs:
            raise ValueError("SamplingBatch needs at least one request")
        dev = torch.device(device)
        V = vocab_size
        ps = [r.params for r in reqs]
        n_out = [len(r.output_token_ids) + (ahead[i] if ahead else 0) for i, r in enumerate(reqs)]

        def f32(vals):
            return h2d(vals, torch.float32, dev)

        greedy = [p.temperature == 0.0 for p in ps]
        all_greedy = all(greedy)
        top_k = top_p = min_p = None
        sampling = [p for p, g in zip(ps, greedy) if not g]
        if any(p.top_k > 0 and p.top_k < V for p in sampling):
            top_k = h2d([p.top_k if 0 < p.top_k < V else V for p in ps], torch.long, dev)
        if any(p.top_p < 1.0 for p in sampling):
            top_p = f32([p.top_p for p in ps])
        if any(p.min_p > 0.0 for p in sampling):
            min_p = f32([p.min_p for p in ps])
        seeded = [(i, mix_seed(p.seed, n_out[i]))
                  for i, (p, g) in enumerate(zip(ps, greedy)) if p.seed is not None and not g]

        pen = [i for i, p in enumerate(ps) if p.needs_penalties]
        pen_rows = rep = pres = freq = seen = counts = None
        if pen:
            P = len(pen)
            pen_rows = h2d(pen, torch.long, dev)
            rep = f32([ps[i].repetition_penalty for i in pen])
            pres = f32([ps[i].presence_penalty for i in pen])
            freq = f32([ps[i].frequency_penalty for i in pen])
            outs = [reqs[i].output_token_ids for i in pen]
            prompts = [reqs[i].prompt_token_ids for i in pen]
            # [P, V + 1] scratch: column V absorbs out-of-vocab ids, then is sliced off (a view)
            counts = _scatter_rows(outs, P, V, dev, torch.float32)
            seen = _scatter_rows(prompts, P, V, dev, torch.bool) | (counts > 0)

        ban_r, ban_t = [], []
        for i, (r, p) in enumerate(zip(reqs, ps)):
            # a grammar decides where its output ends: banning its end token could leave no
            # token allowed
            if n_out[i] < p.min_tokens and r.grammar is None:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stops.update(r.eos_token_ids)
                for t in sorted(stops):
                    if 0 <= t < V:
                        ban_r.append(i)
                        ban_t.append(t)
        ban_rows = h2d(ban_r, torch.long, dev) if ban_r else None
        ban_tokens = h2d(ban_t, torch.long, dev) if ban_t else None
        g_rows, g_bits = _grammar_masks(reqs, V, dev, ahead)

        return SamplingBatch(
            request_ids=[r.request_id for r in reqs], vocab_size=V, device=dev,
            all_greedy=all_greedy,
            greedy=None if all_greedy else h2d(greedy, torch.bool, dev),
            temperature=None if all_greedy else f32([1.0 if g else p.temperature
                                                     for p, g in zip(ps, greedy)]),
            top_k=top_k, top_p=top_p, min_p=min_p, seeded=seeded,
            pen_rows=pen_rows, repetition_penalty=rep, presence_penalty=pres,
            frequency_penalty=freq, seen_mask=seen, output_counts=counts,
            ban_rows=ban_rows, ban_tokens=ban_tokens,
            logprobs=[p.logprobs for p in ps], pen_host=tuple(pen),
            grammar_bitmask=g_bits, grammar_host=g_rows)


def _grammar_masks(reqs: list[Request], V: int, dev: torch.device, ahead: list[int] | None):
    """(rows with a live grammar, bitmask [N, W] on dev), or ((), None) when there are none."""
    rows = tuple(i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.terminated)
    if not rows:
        return (), None
    if ahead and any(ahead[i] for i in rows):
        # the mask depends on every token so far: such rows never run blind (engine/overlap.py)
        raise RuntimeError("a constrained request's previous token is not on the host")
    cuda = dev.type == "cuda"
    bits = torch.full((len(reqs), (V + 31) // 32), -1, dtype=torch.int32, pin_memory=cuda)
    for i in rows:
        reqs[i].grammar.fill(bits, i)
    return rows, bits.to(dev, non_blocking=cuda)
