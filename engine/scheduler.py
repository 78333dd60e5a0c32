"""Scheduler: continuous batching with a token budget, chunked prefill and recompute preemption.

Lifecycle of a Request:

    add()          -> WAITING (back of `waiting`, FIFO by arrival)
    schedule()     -> WAITING -> RUNNING once its first chunk gets blocks (prefix-cache hits are
                      attached at that moment; `num_cached_tokens` records them)
    add_running()  -> RUNNING directly (decode side: prompt KV already in reserved blocks)
    schedule()     -> a RUNNING request that cannot grow is preempted if it is the newest one:
                      blocks freed, num_computed_tokens = 0, back to WAITING at the FRONT of
                      `waiting`, num_preemptions += 1; its outputs are kept and recomputed as
                      part of prompt + output when it is admitted again
    update()       -> RUNNING -> FINISHED_STOPPED (eos / stop token) or FINISHED_LENGTH
                      (max_tokens, max_model_len, or the whole KV cache) ; blocks freed, except
                      for prefill_only requests (the engine exports them, then calls kv.free)
    finish()       -> any -> the given FINISHED_* status (engine: a stop string matched)
    abort()        -> any -> FINISHED_ABORTED, blocks freed

Each step: running requests first, oldest first (a decode takes 1 token; one still in chunked
prefill takes up to the remaining budget less 1 token per later running decode, capped by
long_prefill_token_threshold), then waiting
requests FIFO while budget and max_num_seqs allow. Waiting requests are never admitted by
preempting running ones, and none is admitted in a step that preempted. A waiting request whose
next full block is being computed this step by another request (same prefix) waits one step so
it hits the prefix cache instead of recomputing it; FIFO order is kept (admission stops there).

A waiting request that can never run (its tokens need more blocks than the whole cache holds,
or, with chunked prefill off, more tokens than max_num_batched_tokens) is removed, its status set to FINISHED_ABORTED, `req.error` set, and returned in
`SchedulerOutput.failed` (the engine reports it as an error). A running request stops with
FINISHED_LENGTH before it could outgrow the cache, so preemption cannot loop forever.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


def _remaining(req: Request) -> int:
    return req.num_tokens - req.num_computed_tokens


@dataclass
class ScheduledSeq:
    req: Request
    num_tokens: int  # tokens fed this step: all_token_ids[num_computed : num_computed + num_tokens]
    sample: bool  # this step reaches the end of the known tokens -> sample one token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # can never fit; req.error says why

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        # a request may never hold more tokens than this (model context or the whole cache)
        self.max_len = min(max_model_len, kv.num_blocks * kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last (the preemption victim)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queues ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Decode side: a request whose prompt KV already sits in blocks reserved under its id
        (req.num_computed_tokens = prompt length, output holds the first token)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        if not self.kv.has_blocks(req.request_id):
            raise ValueError(f"request {req.request_id!r} holds no KV blocks")
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)
        self.kv.cache_full_blocks(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _remove(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (a stop string). Frees its blocks unless prefill_only."""
        if not status.finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status}")
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._remove(req)
        req.status = status
        if not req.prefill_only:
            self.kv.free(request_id)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Abort in any state; always frees the request's blocks (also reserved/prefill_only)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(request_id)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step -------------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        t = self.cfg.long_prefill_token_threshold
        if t is not None and n > 1 and self.cfg.enable_chunked_prefill:
            n = min(n, t)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.cfg.max_num_batched_tokens, _remaining, self.kv.allocate)
        if out.preempted:
            return out
        # full blocks this step will compute: a waiting request whose next block is among them
        # waits one step and then hits them instead of recomputing (in-batch prefix sharing)
        pending: set[int] = set()
        if self.waiting and self.kv.enable_prefix_caching:
            for s in out.scheduled:
                pending.update(self.kv.pending_hashes(s.req, s.num_tokens))
        self.admit_waiting(out, budget, pending)
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int, remaining_of, allocate) -> int:
        """schedule()'s first phase: running requests in order into `out`; returns the budget
        left. remaining_of(req): tokens it has to compute; allocate(req, n): blocks for n more
        tokens (False: none free, and the newest running request is preempted). schedule()
        passes the requests' own state; engine/overlap.py's follow passes their state after
        the step in flight (its sampled tokens not known yet) and allocations that never fail
        (it checked the blocks with a dry run first)."""
        max_seqs = self.cfg.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            req = self.running[i]
            remaining = remaining_of(req)
            if remaining <= 0:  # nothing to compute (ended by length in flight); skip, keep order
                i += 1
                continue
            avail = budget
            if remaining > 1:
                # a prefill chunk leaves 1 token for each later running decode (protects TPOT)
                later = sum(1 for r in self.running[i + 1:] if remaining_of(r) == 1)
                avail -= min(later, max_seqs - len(out.scheduled) - 1)
            n = self._chunk(remaining, avail) if avail > 0 else 0
            if n == 0 or (not self.cfg.enable_chunked_prefill and n < remaining):
                i += 1  # no room this step (or a prompt that must run whole): wait
                continue
            while not allocate(req, n):
                victim = self.running[-1]  # newest; never an already scheduled one (they precede i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledSeq(req, n, n == remaining))
                budget -= n
                i += 1
        return budget

    def admit_waiting(self, out: SchedulerOutput, budget: int, pending: set[int],
                      admit=None) -> None:
        """Waiting requests FIFO into `out` (after its running rows) while the token budget,
        max_num_seqs and the free blocks allow; those that can never run go to out.failed.
        pending: hashes of the full blocks the rows already in `out` will compute (a request
        whose next block is among them waits one step, then hits it). schedule()'s second
        phase; engine/overlap.py's follow calls it for a step launched before the previous
        step's tokens are known (they do not change what a waiting request needs).
        admit(req) -> False stops admission at req (FIFO: nothing behind it is admitted)."""
        max_seqs = self.cfg.max_num_seqs
        while self.waiting and budget > 0 and len(out.scheduled) < max_seqs:
            req = self.waiting[0]
            if admit is not None and not admit(req):
                break  # FIFO: nothing behind it either
            if self.kv.blocks_for(req.num_tokens) > self.kv.num_blocks:
                self._fail(req, out, f"request needs {self.kv.blocks_for(req.num_tokens)} KV "
                                     f"blocks, the cache holds {self.kv.num_blocks}")
                continue
            if self.kv.has_blocks(req.request_id):
                self._fail(req, out, f"request id {req.request_id!r} already holds KV blocks "
                                     f"(reserved under the same id?)")
                continue
            hit = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = hit
            remaining = req.num_tokens - hit
            if not self.cfg.enable_chunked_prefill and remaining > self.cfg.max_num_batched_tokens:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                self._fail(req, out, f"{remaining} tokens to prefill exceed max_num_batched_tokens="
                                     f"{self.cfg.max_num_batched_tokens} and chunked prefill is off")
                continue
            n = self._chunk(remaining, budget)
            defer = bool(pending) and self.kv.next_block_hash(req, hit) in pending
            if (defer or (not self.cfg.enable_chunked_prefill and n < remaining)
                    or not self.kv.allocate(req, n)):
                self.kv.free(req.request_id)  # drop attached hits; retried in a later step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = hit
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledSeq(req, n, hit + n == req.num_tokens))
            budget -= n
            if self.kv.enable_prefix_caching:
                pending.update(self.kv.pending_hashes(req, n))

    def _fail(self, req: Request, out: SchedulerOutput, msg: str) -> None:
        """Drop a waiting request that can never run (head of `waiting`)."""
        self.waiting.popleft()
        self.requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED_ABORTED
        req.error = msg  # NOTE: not a Request field; the engine reads it via getattr
        out.failed.append(req)

    # ---- after the model ran ----------------------------------------------------------
    def _check_stop(self, req: Request) -> RequestStatus | None:
        p = req.params
        tok = req.output_token_ids[-1]
        if req.grammar is not None and req.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED  # the structured output is complete
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, stop finished requests (freeing their
        blocks unless prefill_only) and register newly full blocks. Returns the finished ones."""
        finished: list[Request] = []
        running, cache_full_blocks = RequestStatus.RUNNING, self.kv.cache_full_blocks
        for s in out.scheduled:
            req = s.req
            if req.status is not running:
                continue  # aborted / finished between schedule() and update()
            req.num_computed_tokens += s.num_tokens
            status = None
            if s.sample:
                tok = sampled.get(req.request_id)
                if tok is None:
                    raise KeyError(f"no sampled token for request {req.request_id!r}")
                req.output_token_ids.append(int(tok))
                if req.grammar is not None:
                    req.grammar.accept(req.output_token_ids[-1])
                status = self._check_stop(req)
            cache_full_blocks(req)
            if status is not None:
                self._remove(req)
                req.status = status
                if not req.prefill_only:
                    self.kv.free(req.request_id)
                finished.append(req)
        return finished

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions}
