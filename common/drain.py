"""Graceful drain of a service: a server interceptor that refuses the RPCs starting new work
while the process drains (UNAVAILABLE + retry-after-ms), and the wait for the work in flight.

Refused while draining: Reserve and Prefill (new requests) and Load (the gateway's poll, so it
marks this replica down and routes new work elsewhere). Everything a request already in
flight needs goes on: Decode streams, KV transfer, Release, Abort, health.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc

log = logging.getLogger("splitserve.drain")

NEW_WORK = ("Reserve", "Prefill", "Load")
RETRY_AFTER_MS = 5000  # another replica (or this one, restarted) takes the work meanwhile


class DrainGate(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, methods: tuple[str, ...] = NEW_WORK):
        self.service = service
        self.methods = frozenset(methods)
        self.draining = False
        self._refuse = grpc.unary_unary_rpc_method_handler(self._deny)

    async def intercept_service(self, continuation, details):
        if self.draining and details.method.rsplit("/", 1)[-1] in self.methods:
            return self._refuse
        return await continuation(details)

    async def _deny(self, request, context):
        context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"{self.service} is shutting down (draining); retry elsewhere")


async def wait_drained(busy: Callable[[], int], timeout_s: float, cut_short: asyncio.Future,
                       what: str) -> bool:
    """Until busy() is 0 (True), timeout_s passes or cut_short completes (False)."""
    t0 = time.monotonic()
    n = busy()
    if n:
        log.info("%s draining: %d in flight, up to %.0f s", what, n, timeout_s)
    while busy() and time.monotonic() - t0 < timeout_s and not cut_short.done():
        await asyncio.sleep(0.05)
    left = busy()
    if left:
        log.warning("%s: %d still in flight after drain (%.1f s)", what, left, time.monotonic() - t0)
    elif n:
        log.info("%s drained in %.1f s", what, time.monotonic() - t0)
    return not left
