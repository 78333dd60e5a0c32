"""Discrete-event simulation of a P/D cluster replaying a request trace.

Replicas are engines stepping back to back while they have work, as engine/scheduler.py does:
each step runs every running decode row (one token each) and then prompt chunks, oldest first,
within the token budget (max_batched_tokens less one per decode row; a chunk at most `chunk`
tokens) and max_seqs. Step time comes from the calibration (`step_cost`).

    colocated (prefill=0): every replica prefills its own prompts in its decode batches; a prompt
                           samples its first token in the step that finishes it and decodes from
                           the next step on.
    split (xPyD):          prefill replicas run prompts only; the first token is sampled there;
                           the KV then moves to a decode replica (handoff_ms(n) + handoff_fixed_ms)
                           and joins its batch at the next step boundary.

Routing: a prompt to the replica with the fewest queued prompt tokens, a handoff to the decode
replica with the fewest rows. Admission (optional, like the gateway's): reject at arrival when
the queued prompt work ahead plus its own prefill and handoff exceeds the TTFT SLO.
Not modelled: prefix-cache hits, preemption (KV capacity), network jitter.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from planner.calibration import Calibration


@dataclass(frozen=True)
class Cluster:
    prefill: int = 1                 # prefill replicas; 0: colocated (decode replicas prefill)
    decode: int = 1
    max_batched_tokens: int = 2048   # engine SchedulerConfig defaults
    max_seqs: int = 128
    chunk: int | None = None         # long_prefill_token_threshold
    handoff_fixed_ms: float = 0.0    # per-request KV handoff cost besides bytes / rate
    admission: bool = False
    devices: int | None = None       # None: a device per replica; N: replicas share N devices

    def __post_init__(self):
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need prefill >= 0 and decode >= 1 replicas, got {self.prefill}P{self.decode}D")
        if self.max_batched_tokens < 1 or self.max_seqs < 1:
            raise ValueError("max_batched_tokens and max_seqs must be >= 1")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"devices must be >= 1 (or None: one per replica), got {self.devices}")

    @property
    def shape(self) -> str:
        return f"{self.decode}x colocated" if self.prefill == 0 else f"{self.prefill}P{self.decode}D"


@dataclass
class SimRequest:
    idx: int
    arrival_ms: float
    input_len: int
    output_len: int
    status: str = "pending"          # ok | rejected
    done: int = 0                    # prompt tokens computed
    first_ms: float | None = None    # first token
    end_ms: float | None = None      # last token
    finish_step: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_ms is None else self.first_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        if self.output_len < 2 or self.end_ms is None:
            return None
        return (self.end_ms - self.first_ms) / (self.output_len - 1)


def step_cost(cal: Calibration, chunks: list[tuple[int, int]], rows: int, ctx_sum: float,
              ctx_max: float = 0.0) -> float:
    """ms of one step alone on its device: prompt chunks (new tokens, tokens already computed)
    and `rows` decode rows whose contexts sum to ctx_sum (longest ctx_max). A mixed step pays
    the fixed cost once (one forward)."""
    p0, p1, p2 = cal.prefill
    d0, d1, d2 = cal.decode
    t = 0.0
    if chunks:
        t += p0 + sum(p1 * n + p2 * n * (n + past) for n, past in chunks)
    if rows:
        ctx = rows * max(ctx_max, ctx_sum / rows) if cal.padded_attention else ctx_sum
        t += d0 + d1 * rows + cal.row_growth * rows * rows + d2 * ctx + cal.bend_ms(rows)
    if chunks and rows:
        t -= min(p0, d0)
    return t


@dataclass
class Replica:
    idx: int
    prefills: bool
    decodes: bool
    waiting: deque = field(default_factory=deque)   # prompts, FIFO
    joining: list = field(default_factory=list)     # decode rows that start next step
    rows: list = field(default_factory=list)        # heap of (finish_step, idx, request)
    ctx_sum: float = 0.0
    steps: int = 0
    busy: bool = False
    queued_tokens: int = 0                          # prompt tokens not yet computed
    device: int = 0
    work: float = 0.0                               # ms alone left of the step in flight
    version: int = 0                                # its end event's; older ones are stale
    step: dict = field(default_factory=dict)        # the step in flight: chunks, rows

    def ctx_max(self) -> int:
        """Longest context among the running rows (a row's grows by one token a step)."""
        return max((r.input_len + r.output_len - f for f, _, r in self.rows), default=0) + self.steps

    def load(self) -> int:
        return len(self.rows) + len(self.joining)


class Simulator:
    def __init__(self, cal: Calibration, cluster: Cluster, overhead_ms: float | None = None):
        self.cal, self.c = cal, cluster
        self.overhead = cal.ttft_overhead_ms if overhead_ms is None else overhead_ms
        colo = cluster.prefill == 0
        n = cluster.devices
        self.pre = [Replica(i, True, colo, device=i if n is None else i % n)
                    for i in range(cluster.prefill or cluster.decode)]
        self.dec = self.pre if colo else [
            # shared devices: replicas dealt round-robin, prefill first, then decode
            Replica(i, False, True, device=cluster.prefill + i if n is None else (cluster.prefill + i) % n)
            for i in range(cluster.decode)]
        self.active: dict[int, list[Replica]] = {}  # device -> replicas mid-step
        self.synced: dict[int, float] = {}          # device -> when its work was last charged
        self.events: list = []
        self.seq = 0

    def _at(self, t: float, fn, *args) -> None:
        self.seq += 1  # tie-break: events at one time run in the order they were made
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self, reqs: list[SimRequest], ttft_slo_ms: float | None = None,
            concurrency: int | None = None) -> list[SimRequest]:
        """Open loop at each request's arrival_ms; closed loop with `concurrency` clients, each
        sending its next request (arrival_ms rewritten) when its last one ends."""
        self.slo = ttft_slo_ms
        self.backlog = deque(reqs[concurrency:]) if concurrency else deque()
        for r in (reqs[:concurrency] if concurrency else reqs):
            if concurrency:
                r.arrival_ms = 0.0
            if self.cal.ttft_row_ms:  # counted when it is sent
                self._at(r.arrival_ms, self._send, r)
            else:
                self._send(r.arrival_ms, r)
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            fn(t, *args)
        return reqs

    def _ended(self, t: float) -> None:
        if self.backlog:  # closed loop: that client sends its next request
            r = self.backlog.popleft()
            r.arrival_ms = t
            self._send(t, r)

    def _send(self, t: float, r: SimRequest) -> None:
        """The request's serving-path hops before it queues for prefill: a fixed time, plus
        Calibration.ttft_row_ms for each decode row in flight as it is sent."""
        rows = sum(x.load() for x in self.dec) if self.cal.ttft_row_ms else 0
        self._at(t + self.overhead + self.cal.ttft_row_ms * rows, self._arrive, r)

    def _handoff_ms(self, n: int) -> float:
        return 0.0 if self.c.prefill == 0 else self.cal.handoff_ms(n) + self.c.handoff_fixed_ms

    def _arrive(self, t: float, r: SimRequest) -> None:
        rep = min(self.pre, key=lambda x: (x.queued_tokens, x.load()))
        if self.c.admission and self.slo:
            ahead = self.cal.prefill_ms(rep.queued_tokens) if rep.queued_tokens else 0.0
            est = self.overhead + ahead + self.cal.prefill_ms(r.input_len) + self._handoff_ms(r.input_len)
            if est > self.slo:
                r.status, r.end_ms = "rejected", t
                self._ended(t)
                return
        rep.waiting.append(r)
        rep.queued_tokens += r.input_len
        self._kick(t, rep)

    def _kv_ready(self, t: float, r: SimRequest) -> None:
        rep = min(self.dec, key=lambda x: x.load())
        rep.joining.append(r)
        self._kick(t, rep)

    def _kick(self, t: float, rep: Replica) -> None:
        if not rep.busy and (rep.waiting or rep.joining or rep.rows):
            self._start(t, rep)

    def _start(self, t: float, rep: Replica) -> None:
        c = self.c
        while rep.joining and len(rep.rows) < c.max_seqs:
            r = rep.joining.pop(0)
            r.finish_step = rep.steps + r.output_len - 1  # one token a step; the first came with prefill
            heapq.heappush(rep.rows, (r.finish_step, r.idx, r))
            rep.ctx_sum += r.input_len + 1
        rows = len(rep.rows)
        budget = c.max_batched_tokens - rows
        seqs = c.max_seqs - rows
        chunks = []
        for r in rep.waiting:
            if budget <= 0 or seqs <= 0:
                break
            n = min(r.input_len - r.done, budget, c.chunk or budget)
            chunks.append((r, n))
            budget -= n
            seqs -= 1
        if not chunks and not rows:
            return  # rows waiting on max_seqs only: nothing can run until one finishes
        rep.busy = True
        ctx_max = rep.ctx_max() if rows and self.cal.padded_attention else 0
        rep.work = step_cost(self.cal, [(n, r.done) for r, n in chunks], rows, rep.ctx_sum, ctx_max)
        self._share(t, rep.device, add=rep, chunks=chunks, rows=rows)

    def _share(self, t: float, dev: int, add: Replica | None = None, drop: Replica | None = None,
               **step) -> None:
        """Charge the device's steps in flight for the time since the last change at the old
        sharing, change who is in flight, and reschedule every end at the new sharing."""
        act = self.active.setdefault(dev, [])
        if act:
            k = self.cal.stretch(len(act))
            for r in act:
                r.work = max(0.0, r.work - (t - self.synced[dev]) / self._k(r, k))
        self.synced[dev] = t
        if drop is not None:
            act.remove(drop)
        if add is not None:
            act.append(add)
            add.step = step
        k = self.cal.stretch(len(act))
        for r in act:
            r.version += 1
            self._at(t + r.work * self._k(r, k), self._end, r, r.version)

    def _k(self, rep: Replica, k: float) -> float:
        return k if rep.prefills or self.cal.contention_decode else 1.0

    def _end(self, t: float, rep: Replica, version: int) -> None:
        if version != rep.version:
            return  # the sharing changed after this end was scheduled
        self._share(t, rep.device, drop=rep)
        chunks, rows = rep.step["chunks"], rep.step["rows"]
        rep.busy = False
        rep.steps += 1
        rep.ctx_sum += rows
        while rep.rows and rep.rows[0][0] <= rep.steps:
            _, _, r = heapq.heappop(rep.rows)
            r.end_ms, r.status = t, "ok"
            rep.ctx_sum -= r.input_len + r.output_len
            self._ended(t)
        for r, n in chunks:
            r.done += n
            rep.queued_tokens -= n
            if r.done < r.input_len:
                continue
            rep.waiting.remove(r)
            r.first_ms = t
            if r.output_len <= 1:
                r.end_ms, r.status = t, "ok"
                self._ended(t)
            elif rep.decodes:
                rep.joining.append(r)
            else:
                self._at(t + self._handoff_ms(r.input_len), self._kv_ready, r)
        self._kick(t, rep)


def simulate(reqs: list[SimRequest], cal: Calibration, cluster: Cluster,
             ttft_slo_ms: float | None = None, overhead_ms: float | None = None,
             concurrency: int | None = None) -> list[SimRequest]:
    """Replay `reqs` (fresh SimRequests: the run fills them in) through `cluster`; open loop,
    or closed loop with `concurrency` clients."""
    return Simulator(cal, cluster, overhead_ms).run(reqs, ttft_slo_ms, concurrency)
