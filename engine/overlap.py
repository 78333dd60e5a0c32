"""Overlapped decode ("async scheduling"): the next step is launched before the current
step's tokens reach the host, so the host's work between two steps (reading the
tokens, scheduler update, outputs, staging and launching the next step) runs while the GPU
computes instead of leaving it idle.

    step k:   launch S_k ------------------------------+
              can S_k be followed blindly? -> launch S_k+1 with S_k's tokens as its
                                                input ids, copied on the device
              wait for S_k's tokens (pinned copy + event, not a stream sync), update,
              outputs of S_k
    step k+1: (S_k+1 already in flight) launch S_k+2 ..., outputs of S_k+1

A step may follow blindly (`plan_follow`) when the previous step was itself launched
overlapped (its sampled tokens stay on the device) and the cache has the blocks the next one
needs (no preemption). The blind step is built by the scheduler's own
rules on the state after the previous step:
- running rows (`Scheduler.schedule_running`): a decode row for each request that step
  sampled (its input id copied from the device, at its flat position), the next chunk of
  each prompt it ran an earlier chunk of, and requests it did not run from their own state
  (e.g. those the decode service adds with their prompt's KV in place:
  Engine.add_prefilled); requests its unseen token ends by length are left out;
- waiting requests (`Scheduler.admit_waiting`: FIFO, token budget, free slots and blocks),
  so an arrival does not stop the overlap; the full blocks of the step in flight are
  registered in the prefix cache first, so an arrival sharing them hits them. A slot that a
  request ending by length frees is taken in the same step; its blocks come back once the
  step in flight is done, so a waiting request short of blocks may start a step later than
  without overlap. A prefill-only request (KV pushed layer by layer) at the head of the queue
  makes the engine wait and schedule normally;
- sampling: seeds and min_tokens bans count the token still on the device, penalties add
  its value to their counts on the device; logprobs are computed on the device with the
  tokens and read back with them.
A request that stops on the token the host has not seen yet (eos, stop token, stop string,
abort) has one wasted row in the step already launched; its output is dropped, and its blocks
are freed only after that step completed (KVCacheManager.fence): a KV import from another
process must not land in a block a running step still writes.

Seen on an H200 (bench/decode_loop.py): the host work between two decode steps is ~200 us per
step at batch 1 (graph staging and launch ~90 us, sampler launch and readback, scheduler,
outputs): 5% of an 8B step, 20% of a 1B step, which the overlap hides.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.h2d import h2d
from engine.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from engine.request import Request
from engine.runner import StepInput
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


@dataclass
class Launched:
    """One step on its way: its schedule, and its sampled tokens (a synchronous step's
    SamplerOutput, or an overlapped step's device tensor with its host copy in flight)."""
    sched: SchedulerOutput
    sample_reqs: list[Request]
    batch: SamplingBatch | None
    seq: int
    t0: float = field(default_factory=time.perf_counter)
    out: SamplerOutput | None = None
    tokens: torch.Tensor | None = None  # device token ids, one per sampled row
    logprobs: list[torch.Tensor] | None = None  # Sampler.logprobs_device's, where rows ask
    host: torch.Tensor | None = None  # the tokens' host copy (pinned on CUDA)
    host_logprobs: list[torch.Tensor] | None = None
    event: torch.cuda.Event | None = None  # recorded after the copies

    @property
    def overlapped(self) -> bool:
        return self.tokens is not None

    def result(self) -> SamplerOutput | None:
        """The sampled tokens (and logprobs); waits for this step (and nothing launched after
        it)."""
        if self.tokens is not None and self.out is None:
            if self.event is not None:
                self.event.synchronize()
            n = len(self.sample_reqs)
            lps = (Sampler.logprobs_list(self.host_logprobs, self.batch)
                   if self.host_logprobs is not None else [None] * n)
            self.out = SamplerOutput(self.host[:n].tolist(), lps)
        return self.out


class TokenReadback:
    """Host copies of overlapped steps' tokens: two pinned buffers used in turn (at most two
    steps are in flight, and a step's copy is read before the step after next is launched)."""

    def __init__(self, max_rows: int, device: torch.device):
        cuda = torch.device(device).type == "cuda"
        self._bufs = [torch.empty(max_rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._cuda = cuda

    def start(self, launched: Launched) -> None:
        n = launched.tokens.shape[0]
        host = self._bufs[launched.seq % 2]
        host[:n].copy_(launched.tokens, non_blocking=self._cuda)
        launched.host = host
        if launched.logprobs is not None:  # small: pinned buffers from torch's host cache
            launched.host_logprobs = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=self._cuda).copy_(t, non_blocking=self._cuda)
                for t in launched.logprobs]
        if self._cuda:
            launched.event = torch.cuda.Event()
            launched.event.record()


def blind_admissible(req: Request) -> bool:
    """Whether a request may be in a step run overlapped (its tokens and logprobs read back
    later, or launched before the previous step's tokens are known): not one whose KV is pushed
    layer by layer during the step (prefill-only requests of a disaggregated prefill service),
    nor a constrained one (its token mask needs every token before it on the host)."""
    return not req.prefill_only and req.grammar is None


def can_overlap(sched: SchedulerOutput) -> bool:
    """Whether a scheduled step may run overlapped: every request in it is blind_admissible."""
    return all(blind_admissible(s.req) for s in sched.scheduled)


@dataclass
class FollowPlan:
    """What plan_follow found: the running requests' rows in the step in flight (`ahead`, by
    id) and the projected tokens each running request has left to compute once that step is
    done (`remaining_of`: a sampled token still unseen counts 1, or 0 when it ends the request
    by length; a request with no row in flight, e.g. one the decode service added with its
    prompt's KV in place, counts its own)."""
    ahead: dict[int, ScheduledSeq]
    ends: set[int]
    # a decode-only step: every running request in order with the tokens it has left
    # (remaining_of: 0 or 1), which is all the running phase needs (follow's fast path)
    decode_rows: list[tuple[Request, int]] | None = None

    def __post_init__(self):
        # tokens_ahead is read several times a row a step: one dict lookup, no attribute
        self.n_ahead = {k: s.num_tokens for k, s in self.ahead.items()}

    def tokens_ahead(self, req: Request) -> int:
        return self.n_ahead.get(id(req), 0)

    def remaining_of(self, req: Request) -> int:
        a = self.ahead.get(id(req))
        if a is not None and a.sample:
            return 0 if id(req) in self.ends else 1  # prev's token is its next input
        return req.num_tokens - req.num_computed_tokens - (a.num_tokens if a is not None else 0)


def plan_follow(prev: Launched, sched: Scheduler) -> FollowPlan | None:
    """Whether the step after `prev` may be launched before prev's tokens are known, i.e.
    would be scheduled as `follow` builds it (see the module docstring), or None. The running
    requests go through the scheduler's own running phase on the state after prev
    (Scheduler.schedule_running, first as a dry run here for the blocks it needs): prev's
    sampled rows continue as decode rows, its rows with an earlier chunk of a prompt with
    their next chunk, requests prev did not run (added since, or left out for budget) from
    their own state. A request that prev's token ends by length (max_tokens, the model
    length) is left out: the scheduler would not run it again either."""
    # a waiting request the next schedule could admit (or fail) with a free sequence slot:
    # follow admits it too, unless it needs what a blind step cannot give (blind_admissible);
    # then the next step is scheduled synchronously, so it is never passed over
    if (sched.waiting and len(sched.running) < sched.cfg.max_num_seqs
            and not blind_admissible(sched.waiting[0])):
        return None
    # the running phase may take any running request, also ones prev did not run
    if not prev.overlapped or not sched.running or not all(map(blind_admissible, sched.running)):
        return None
    ends: set[int] = set()
    for s in prev.sched.scheduled:
        r = s.req
        if r.finished or not s.sample:
            continue  # (a request that ended since is no longer running)
        p = r.params
        n_out = len(r.output_token_ids)  # prev's token not yet among them
        if n_out + 1 >= p.max_tokens or r.num_tokens + 1 >= sched.max_len:
            ends.add(id(r))  # prev's token ends it (scheduler._check_stop's length rule)
    if all(id(r) in ends for r in sched.running):
        return None  # nothing left to continue: the scheduler decides
    plan = FollowPlan({id(s.req): s for s in prev.sched.scheduled}, ends)
    kv = sched.kv
    need = 0

    def count(req: Request, n: int) -> bool:
        nonlocal need
        need += max(0, kv.blocks_needed(req, plan.tokens_ahead(req) + n))
        return True

    left = [(r, plan.remaining_of(r)) for r in sched.running]
    if all(n <= 1 for _, n in left) and len(left) <= sched.cfg.max_num_batched_tokens:
        # decode rows only: the running phase gives each request not ending one token
        n_ahead = plan.n_ahead
        need = kv.blocks_needed_total((r, n_ahead.get(id(r), 0) + 1) for r, n in left if n)
        if need > kv.num_free_blocks:
            return None
        plan.decode_rows = left
        return plan
    dry = SchedulerOutput()
    sched.schedule_running(dry, sched.cfg.max_num_batched_tokens, plan.remaining_of, count)
    if not dry.scheduled or need > kv.num_free_blocks:
        return None  # nothing to run (the scheduler decides), or it would preempt
    return plan


def follow(prev: Launched, plan: FollowPlan, sched: Scheduler, seq: int, sampling_batch):
    """The step after `prev` as plan_follow planned it: the running requests through the
    scheduler's running phase on the state after prev (decode rows for those prev sampled,
    the next chunk for prompts prev ran an earlier chunk of), then the waiting requests the
    scheduler admits beside them (Scheduler.admit_waiting: the same FIFO, budget, slot and
    block rules as schedule()). Returns its Launched, its runner rows, the device tensor of the
    decode rows' input tokens (prev's tokens, or those of the rows that continue) and their
    flat positions among the step's input ids (None: the leading ones). The blocks are taken
    now. Requests that can never run are in the Launched's sched.failed. sampling_batch(reqs)
    builds a SamplingBatch when the sampled requests differ from prev's.
    NOTE: the blocks prev completes are registered in the prefix cache first (their KV is
    written before this step runs), so an admitted prompt hits them as it would after prev's
    update; a request that prev's unseen token stops (eos, stop token) still holds its slot and
    blocks here, so a waiting request may be admitted one step later than without overlap."""
    kv = sched.kv

    def allocate(req: Request, n: int) -> bool:
        if not kv.allocate(req, plan.tokens_ahead(req) + n):
            raise RuntimeError(f"overlapped step: no block for request {req.request_id!r}")
        return True

    out = SchedulerOutput()
    if plan.decode_rows is not None:
        budget = _decode_rows(out, plan, sched, kv)
    else:
        budget = sched.schedule_running(out, sched.cfg.max_num_batched_tokens, plan.remaining_of, allocate)
    rows, tok_reqs, tok_pos, flat = [], [], [], 0
    for s in out.scheduled:
        r = s.req
        a = plan.ahead.get(id(r))
        start = r.num_computed_tokens + (a.num_tokens if a is not None else 0)
        if a is not None and a.sample:  # a decode row: its input is prev's token, on the device
            rows.append(StepInput(r.request_id, [0], start, kv.block_ids(r.request_id), True))
            tok_reqs.append(r)
            tok_pos.append(flat)
        else:  # a prompt's next chunk, or a request prev did not run: tokens from the host
            rows.append(StepInput.of_request(r, start, s.num_tokens, kv.block_ids(r.request_id), s.sample))
        flat += len(rows[-1].token_ids)
    n_run = len(out.scheduled)
    if sched.waiting:
        pending: set[int] = set()
        for s in prev.sched.scheduled:
            kv.cache_full_blocks(s.req, s.req.num_computed_tokens + s.num_tokens)
        if kv.enable_prefix_caching:
            # the blocks this step completes; a decode row's would hold prev's unseen token
            for s in out.scheduled:
                a = plan.ahead.get(id(s.req))
                if a is None or not a.sample:
                    pending.update(kv.pending_hashes(s.req, plan.tokens_ahead(s.req) + s.num_tokens))
        sched.admit_waiting(out, budget, pending, blind_admissible)
        for s in out.scheduled[n_run:]:
            r = s.req
            rows.append(StepInput.of_request(r, r.num_computed_tokens, s.num_tokens,
                                             kv.block_ids(r.request_id), s.sample))
    sample = [s.req for s in out.scheduled if s.sample]
    if _same(tok_reqs, prev.sample_reqs):
        tokens = prev.tokens
    else:
        pos = {id(r): i for i, r in enumerate(prev.sample_reqs)}
        idx = h2d([pos[id(r)] for r in tok_reqs], torch.long, prev.tokens.device)
        tokens = prev.tokens.index_select(0, idx)
    if not sample:
        batch = None  # earlier chunks only
    elif _same(sample, prev.sample_reqs) and not prev.batch.step_dependent:
        batch = prev.batch
    else:  # the rows continuing prev have one more token than their requests show
        cont = {id(r): i for i, r in enumerate(tok_reqs)}
        src = [cont.get(id(r)) for r in sample]  # each sampled row's token in `tokens`
        batch = sampling_batch(sample, [int(i is not None) for i in src])
        batch.count_pending(src, tokens)  # penalties count that token's value too
    leading = tok_pos == list(range(len(tok_pos)))
    return Launched(out, sample, batch, seq), rows, tokens, None if leading else tok_pos


def _decode_rows(out: SchedulerOutput, plan: FollowPlan, sched: Scheduler, kv) -> int:
    """Scheduler.schedule_running for a decode-only step (plan.decode_rows): the same rows in
    the same order under the same token budget and max_num_seqs (a request with one token
    left runs it, whole and sampled; one with none is skipped), without the per-row calls
    a chunked prompt needs. Returns the budget left."""
    budget, max_seqs = sched.cfg.max_num_batched_tokens, sched.cfg.max_num_seqs
    scheduled, n_ahead = out.scheduled, plan.n_ahead
    for req, n in plan.decode_rows:
        if budget <= 0 or len(scheduled) >= max_seqs:
            break
        if n <= 0:
            continue
        if not kv.allocate(req, n_ahead.get(id(req), 0) + 1):
            raise RuntimeError(f"overlapped step: no block for request {req.request_id!r}")
        scheduled.append(ScheduledSeq(req, 1, True))
        budget -= 1
    return budget


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
