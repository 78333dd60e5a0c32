"""The engine's request state object, and what a step returns for one request.

Lifecycle (see engine.scheduler): WAITING -> RUNNING -> FINISHED_*; a preempted
request goes back to WAITING with its computed tokens dropped (recompute).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # eos, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str):
        # NOTE: a plain attribute: Request.finished is read for every row several times a step
        # (a property testing membership cost ~6x as much)
        self.is_finished = value in ("stop", "length", "abort")

    @property
    def finished(self) -> bool:
        return self.is_finished


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prompt + outputs). The scheduler advances it.
    num_computed_tokens: int = 0
    # Prefix-cache hits found at first scheduling (tokens), for stats.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefill-only requests (prefill service) finish after the first sampled token and keep
    # their blocks until the KV has been exported (`Engine.release`).
    prefill_only: bool = False
    # Logprobs per output token: (chosen_logprob, [(token_id, logprob), ...]).
    output_logprobs: list = field(default_factory=list)
    first_token_time: float | None = None
    # constrained decoding (params.guided): engine.structured.GrammarState, advanced by each
    # output token (Scheduler.update; Engine.add_prefilled for the token prefill sampled)
    grammar: object | None = None
    scheduled_time: float | None = None  # first scheduled (monotonic): ends its queue time

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.is_finished


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list = field(default_factory=list)  # per new token: (logprob, [(id, logprob)]) or None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # a finished prefill-only request: the blocks holding its prompt's KV, in order (they stay
    # held until release), so a handoff needs no second trip to the engine thread
    block_ids: list[int] | None = None
    # the output carrying a request's first sampled token: seconds it waited to be scheduled
    # and from then to that token (None on later outputs and on requests joined prefilled)
    queue_s: float | None = None
    prefill_s: float | None = None
