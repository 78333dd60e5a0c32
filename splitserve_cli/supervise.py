"""`splitserve up`'s supervision of its children (prefill, decode, the gateway's workers) once
they are up: a child that dies is started again on the ports it had (so the gateway's channels
and the tickets' addresses stay valid), after a backoff that doubles while it keeps dying
(1 s .. 30 s) and resets once it has stayed up a minute; each restart is one log line with
its counter (and the child's splitserve_process_restarts metric). A child that dies more than
`max_restarts` times in a row (0: the first time) stops everything, as does a signal (graceful:
the gateway's workers drain first, then the services).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

BACKOFF_S = (1.0, 30.0)  # first wait, longest wait
STABLE_S = 60.0  # up this long: the next death starts the backoff over
KILL_AFTER_S = 10.0  # past the drain timeout: SIGKILL


def _say(msg: str) -> None:
    print(f"splitserve up: {msg}", file=sys.stderr, flush=True)


def is_gateway(name: str) -> bool:
    """The gateway's workers are "gateway", "gateway-1", ... (`up --gateway-workers`)."""
    return name == "gateway" or name.startswith("gateway-")


def pin_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with flag's value replaced (`--flag V` or `--flag=V`), or appended when absent."""
    out, i, done = [], 0, False
    while i < len(argv):
        x = argv[i]
        if not done and x == flag and i + 1 < len(argv):
            out += [flag, value]
            i, done = i + 2, True
            continue
        if not done and x.startswith(flag + "="):
            out.append(f"{flag}={value}")
            i, done = i + 1, True
            continue
        out.append(x)
        i += 1
    return out if done else out + [flag, value]


def pinned_argv(name: str, argv: list[str], ready: list[str]) -> list[str]:
    """The child's command line with the ports it got the first time (its ready file): a
    restarted child must be found where its peers already dial it."""
    argv = pin_flag(argv, "--port", ready[0])
    second = "--http-port" if is_gateway(name) else "--metrics-port"
    if len(ready) > 1 and ready[1] != "-1":
        argv = pin_flag(argv, second, ready[1])
    return argv


class Slot:
    """One supervised child: its current process, how to start it again, its restart count."""

    def __init__(self, child, argv: list[str]):
        self.child = child
        self.argv = argv  # ports pinned
        self.restarts = 0  # in all
        self.streak = 0  # deaths in a row without STABLE_S of uptime
        self.started = time.monotonic()
        self.restart_at: float | None = None  # dead, waiting out its backoff
        self.starting = False  # restarted, its ready file not written yet


class Supervisor:
    def __init__(self, children: list, ready: dict[str, list[str]], spawn: Callable, *,
                 max_restarts: int, drain_timeout_s: float):
        """children: up's Child objects (started, ready); spawn(name, argv, ready_file, restarts)
        -> a new Child (restarts: its count so far, SPLITSERVE_RESTARTS in its environment);
        max_restarts < 0: no limit."""
        self.slots = {c.name: Slot(c, pinned_argv(c.name, c.argv, ready[c.name])) for c in children}
        self.spawn = spawn
        self.max_restarts = max_restarts
        self.drain_timeout_s = drain_timeout_s

    @property
    def children(self) -> list:
        return [s.child for s in self.slots.values()]

    def run(self, stop: dict, poll_s: float = 0.2) -> str | None:
        """Until stop["sig"] is set (-> None) or a child is past its restarts (-> why)."""
        while stop["sig"] is None:
            now = time.monotonic()
            for name, s in self.slots.items():
                why = self._check(name, s, now)
                if why is not None:
                    return why
            time.sleep(poll_s)
        return None

    def _check(self, name: str, s: Slot, now: float) -> str | None:
        c = s.child
        if s.starting and c.alive() and c.ready():
            s.starting = False
            _say(f"{name} is back (restart {s.restarts}, pid {c.proc.pid})")
        if c.alive() or s.restart_at is not None and now < s.restart_at:
            return None
        if s.restart_at is None:  # just found dead
            if self.max_restarts == 0:
                return f"{name} stopped ({c.why()}); the others were stopped"
            if now - s.started >= STABLE_S and not s.starting:
                s.streak = 0
            s.streak += 1
            if 0 <= self.max_restarts < s.streak:
                return (f"{name} stopped ({c.why()}) after {s.streak - 1} restart(s) in a row; "
                        f"the others were stopped")
            wait = min(BACKOFF_S[0] * 2 ** (s.streak - 1), BACKOFF_S[1])
            s.restart_at = now + wait
            _say(f"{name} died ({c.why()}); restart {s.restarts + 1} in {wait:.0f} s")
            return None
        s.restart_at = None
        s.restarts += 1
        try:
            os.unlink(c.ready_file)
        except FileNotFoundError:
            pass
        s.child = self.spawn(name, s.argv, c.ready_file, s.restarts)
        s.started, s.starting = time.monotonic(), True
        return None

    def stop_all(self) -> None:
        """Graceful: SIGTERM to the gateway, which drains (its streams still need the services),
        then to the services, which drain what is left; SIGKILL to any still alive
        KILL_AFTER_S past the drain timeout."""
        order = [s.child for n, s in self.slots.items() if is_gateway(n)]
        order += [self.slots[n].child for n in ("prefill", "decode") if n in self.slots]
        stop_in_order(order, self.drain_timeout_s)


def stop_in_order(children: list, drain_timeout_s: float) -> None:
    """children: gateway first. Each group gets SIGTERM and its drain time before the next."""
    front = [c for c in children if is_gateway(c.name)]
    back = [c for c in children if not is_gateway(c.name)]
    for group in (front, back):
        for c in group:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + drain_timeout_s + KILL_AFTER_S
        for c in group:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{c.name} did not stop in {drain_timeout_s + KILL_AFTER_S:.0f} s; killing it")
                c.proc.kill()
                c.proc.wait()
