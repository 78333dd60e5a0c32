"""Load from several client processes: one Python process reading 64 gRPC streams spends tens
of microseconds a message on its own loop, so at a 2 ms step it, not the system, can set the
pace. ClientPool splits a case's prompts over N worker processes (each with its own channel, as
separate users have) and merges their Traces; perf_counter is CLOCK_MONOTONIC on Linux, so
times from all workers share one clock.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import time


def _work(api: str, addr: str, model: str, prompts: list[list[int]], max_tokens: int,
          logprobs, start_at: float, channels: int = 1):
    from bench.pd_clients import run_system

    delay = start_at - time.perf_counter()
    if delay > 0:  # every worker sends at the same instant
        time.sleep(delay)
    return asyncio.run(run_system(api, addr, model, prompts, max_tokens, logprobs, channels=channels))


def _ready() -> bool:
    import grpc  # noqa: F401 - imported once, before a timed case

    from bench import pd_clients  # noqa: F401
    return True


def split(items: list, n: int) -> list[list]:
    """items dealt round-robin into at most n non-empty parts (their order kept within a part)."""
    parts = [items[i::n] for i in range(min(n, len(items)))]
    return [p for p in parts if p]


class ClientPool:
    """procs worker processes (spawned: no CUDA or event loop state inherited), kept for the
    whole run so later cases pay no start-up."""

    def __init__(self, procs: int, channels: int = 1, lead_s: float = 0.05):
        """channels: gRPC connections in each worker."""
        self.procs, self.channels, self.lead_s = procs, channels, lead_s
        self._ex = concurrent.futures.ProcessPoolExecutor(
            procs, mp_context=multiprocessing.get_context("spawn"))
        for f in [self._ex.submit(_ready) for _ in range(procs)]:
            f.result()

    def run(self, api: str, addr: str, model: str, prompts: list[list[int]], max_tokens: int,
            logprobs=None) -> list:
        """Traces in prompts' order; raises the first worker's error."""
        parts = split(list(range(len(prompts))), self.procs)
        start_at = time.perf_counter() + self.lead_s
        futs = [self._ex.submit(_work, api, addr, model, [prompts[i] for i in idx], max_tokens,
                                logprobs, start_at, self.channels) for idx in parts]
        out: list = [None] * len(prompts)
        for idx, f in zip(parts, futs):
            for i, tr in zip(idx, f.result()):
                out[i] = tr
        return out

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
