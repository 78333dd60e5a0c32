"""Process runtime shared by prefill_svc and decode_svc: engine thread, gRPC server with
health + reflection, /metrics port, graceful drain and stop on SIGINT/SIGTERM.

Tracing helpers are common/telemetry.py's, metrics common/metrics.py's; the services use them
directly.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from common import telemetry
from common.drain import DrainGate, wait_drained
from common.envs import env_int
from common.grpc_util import (add_health_and_reflection, bind, create_server, freeze_heap, set_serving,
                              wait_for_signal)
from common.metrics import get_metrics
from common.trace_profile import add_profile_service
from common.service_args import apply_switch_interval, write_ready_file

log = logging.getLogger("splitserve.runtime")


@dataclass
class Rate:
    """Tokens/s from a cumulative counter sampled now and then."""
    window_s: float = 5.0
    samples: list[tuple[float, float]] = field(default_factory=list)

    def update(self, total: float) -> float:
        now = time.monotonic()
        self.samples.append((now, float(total)))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.pop(0)
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


async def serve(service: str, args, engine, register: Callable[[object], list[str]],
                on_stop: Callable[[], object] | None = None,
                started: Callable[[int], object] | None = None,
                busy: Callable[[], int] | None = None) -> int:
    """Start engine + server, serve until a signal, drain, stop cleanly.

    register(server) adds the servicers and returns their full service names; started(port)
    runs once bound (before SERVING), e.g. to learn the advertised address; busy() counts the
    requests in flight, which a signal lets finish for up to args.drain_timeout_s (health
    NOT_SERVING and new work refused meanwhile: common/drain.py)."""
    apply_switch_interval(getattr(args, "gil_switch_interval_ms", None))
    await engine.start()
    metrics = get_metrics(service, engine.info()["model"])
    metrics.restarts.set(env_int("SPLITSERVE_RESTARTS", 0))  # set by `up` when it restarts us
    auth = getattr(args, "internal_auth", None)  # common.auth.InternalAuth (service_main)
    gate = DrainGate(service)
    server = create_server(auth, [gate])
    names = register(server)
    add_profile_service(server, engine, service, getattr(args, "profile_dir", None))
    hs = add_health_and_reflection(server, names)
    port = bind(server, args.host, args.port, auth)
    if started is not None:
        started(port)
    await server.start()
    mport = None
    if args.metrics_port is not None:
        mport = metrics.serve(args.metrics_port, args.host)
    updater = asyncio.get_running_loop().create_task(_update_metrics(metrics, engine))
    freeze_heap()
    await set_serving(hs, names, True)
    write_ready_file(args.ready_file, port, mport)
    log.info("%s serving on %s:%d (metrics port %s)", service, args.host, port, mport)
    rc, signalled = 0, False
    try:
        # a dead engine thread ends the process (exit 1) so a supervisor restarts it
        sig = asyncio.ensure_future(wait_for_signal())
        done, _ = await asyncio.wait({sig, updater}, return_when=asyncio.FIRST_COMPLETED)
        if updater in done:
            log.error("%s: engine thread died (%s); stopping", service, updater.result())
            rc = 1
        signalled = sig in done
        sig.cancel()
    finally:
        log.info("%s stopping", service)
        gate.draining = True
        await set_serving(hs, names, False)
        if signalled and busy is not None:  # a second signal cuts the drain short
            again = asyncio.ensure_future(wait_for_signal())
            await wait_drained(busy, getattr(args, "drain_timeout_s", 30.0), again, service)
            again.cancel()
        updater.cancel()
        await server.stop(grace=1.0)
        if on_stop is not None:
            res = on_stop()
            if asyncio.iscoroutine(res):
                await res
        await engine.stop()
        if mport is not None:
            metrics.stop_serving()
        with contextlib.suppress(Exception):
            telemetry.shutdown_tracing()
    return rc


async def _update_metrics(metrics, engine, interval_s: float = 1.0) -> str:
    """Refresh gauges from engine stats; returns (ending the service) if the engine died."""
    while True:
        await asyncio.sleep(interval_s)
        if engine.dead is not None:  # what crashed the engine thread
            return repr(engine.dead)
        try:
            metrics.update_from_engine_stats(engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never take the service down
            log.debug("metrics update failed", exc_info=True)
