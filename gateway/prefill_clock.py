"""Where a prefill replica's engine stands in its step loop, as the gateway sees it from its own
prompts: which of them are in the step running now, which wait for a later one, how long the
running step has run, and how fast new prompts arrive. The TTFT fit (gateway/ttft_fit.py)
predicts from these.

The engine prefills in steps: each step takes the prompts waiting when it starts, up to its
token budget (`max_num_batched_tokens`), and every prompt in it gets its first token when the
step ends. So a prompt's TTFT is the rest of the running step plus its own step (plus whole
steps when more than a budget is queued ahead), and prompts admitted after it until its step
starts join that step and lengthen it. The gateway cannot see the engine's steps, only its own
prompts start and finish: a step began at the later of the last prompt it saw finish and the
oldest prompt still in flight, and holds the prompts admitted before that.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

RATE_WINDOW_S = 0.5  # admitted tokens over this long make the arrival rate
STALE_S = 300.0      # an entry this old is dropped (a bookkeeping leak, never a real prompt)


@dataclass(frozen=True)
class Ahead:
    """The prefill work ahead of a new prompt on one replica, at the admit decision."""
    running_tokens: int = 0     # in the step running now (at most the budget); 0: idle
    queued_tokens: int = 0      # admitted, waiting for a later step
    elapsed_ms: float = 0.0     # since the running step began
    tokens_per_ms: float = 0.0  # prompt tokens admitted there recently, per ms
    budget: int | None = None   # the replica's step token budget (None: not reported)

    @property
    def busy(self) -> bool:
        return self.running_tokens > 0


class PrefillClock:
    """One prefill replica's in-flight prompts (admit time, new tokens), in admit order, and the
    time the last of them finished (monotonic seconds). peers (gateway/clock_board.py's
    BoardView): the sibling gateway workers' prompts there, merged into `ahead`."""

    def __init__(self, peers=None):
        self._open: dict[int, tuple[float, int]] = {}  # key -> (admitted at, tokens), admit order
        self._keys = itertools.count(1)
        self._recent: deque[tuple[float, int]] = deque()  # admits within RATE_WINDOW_S
        self.last_done = -math.inf
        self.peers = peers

    def _share(self, now: float) -> None:
        if self.peers is not None:
            self._prune(now)
            self.peers.publish(list(self._open.values()), self.last_done, list(self._recent))

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, tokens: int, now: float) -> int:
        """A prompt sent there -> its key for `done`."""
        key = next(self._keys)
        self._open[key] = (now, max(int(tokens), 0))
        self._recent.append((now, max(int(tokens), 0)))
        self._share(now)
        return key

    def done(self, key: int | None, now: float, finished: bool = True) -> None:
        """Its Prefill call ended; finished: with a first token (a step ended then), not an
        error or a cancel (which end no step)."""
        if self._open.pop(key, None) is not None:
            if finished:
                self.last_done = max(self.last_done, now)
            self._share(now)

    def rate(self, now: float, more: list[tuple[float, int]] = ()) -> float:
        """Prompt tokens admitted over the last RATE_WINDOW_S, per ms (more: the siblings')."""
        self._prune(now)
        lo = now - RATE_WINDOW_S
        return (sum(k for _, k in self._recent) + sum(k for t, k in more if t >= lo)) / (RATE_WINDOW_S * 1e3)

    def ahead(self, now: float, budget: int | None = None, polled_queued: int = 0) -> Ahead:
        """The work ahead of a prompt admitted now. polled_queued: the replica's own count of
        waiting prompt tokens (other clients' prompts too); what exceeds ours queues as well."""
        for k in [k for k, (t, _) in self._open.items() if t < now - STALE_S]:
            del self._open[k]
        opens, last_done, more = list(self._open.values()), self.last_done, []
        for o, done, recent in (self.peers.others() if self.peers is not None else ()):
            opens += [(t, k) for t, k in o if t >= now - STALE_S]
            last_done, more = max(last_done, done), more + recent
        rate = self.rate(now, more)
        if not opens:
            return Ahead(0, max(polled_queued, 0), 0.0, rate, budget)
        start = max(last_done, min(t for t, _ in opens))
        running = sum(k for t, k in opens if t <= start)
        total = sum(k for _, k in opens)
        if budget:
            running = min(running, budget)
        queued = total - running + max(polled_queued - total, 0)
        return Ahead(max(running, 1), queued, max(now - start, 0.0) * 1e3, rate, budget)
