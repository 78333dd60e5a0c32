"""`splitserve up`'s child processes: start one (its stderr passed through and its last lines
kept, so a death can be told in one line), wait for their ready files, stop them."""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 10.0


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `up` itself is killed (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the signal handlers below still apply
        pass


# a log line's prefix (common/log.py): "2026-01-01 12:00:00,000 ERROR [decode] splitserve.x: "
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ +[A-Z]+ +(\[[^\]]*\] +)?[\w.]+: ")
_ERRORISH = re.compile(r"Error|Exception|error|ERROR|CRITICAL|cannot|failed|in use|not found|"
                       r"No such|denied")


class Child:
    def __init__(self, name: str, argv: list[str], ready_file: str, env: dict):
        self.name, self.argv, self.ready_file = name, argv, ready_file
        # NOTE: own process group so a terminal Ctrl-C reaches us first; we stop them in order.
        # stderr (its logs) passes through us so the last lines can say why it died.
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._pump = threading.Thread(target=self._forward, name=f"{name}-stderr", daemon=True)
        self._pump.start()

    def _forward(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for raw in iter(self.proc.stderr.readline, b""):
            try:
                if out is not None:
                    out.write(raw)
                else:
                    sys.stderr.write(raw.decode(errors="replace"))
                sys.stderr.flush()
            except (OSError, ValueError):  # our own stderr is gone: keep draining the pipe
                pass
            line = raw.decode(errors="replace").rstrip()
            if line.strip():
                self.tail.append(line)

    def why(self) -> str:
        """One line: how it ended and its last error line."""
        self._pump.join(timeout=2.0)  # the pipe's last lines
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                how = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
            if rc == -signal.SIGKILL:
                how += " (out of memory?)"
        else:
            how = f"exit code {rc}"
        lines = list(self.tail)
        # the last error line among the last few (a traceback ends in its exception), else the
        # last line of a process that exited on its own
        reason = next((ln for ln in reversed(lines[-5:]) if _ERRORISH.search(ln)),
                      lines[-1] if lines and rc is not None and rc > 0 else "")
        reason = _LOG_PREFIX.sub("", reason).strip()
        return f"{how}: {reason}" if reason else how

    def ready(self) -> list[str] | None:
        if not os.path.exists(self.ready_file):
            return None
        with open(self.ready_file) as f:
            return f.read().split()

    def alive(self) -> bool:
        return self.proc.poll() is None


def service_cmd(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def wait_ready(children: list[Child], timeout_s: float) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout_s
    out: dict[str, list[str]] = {}
    while len(out) < len(children):
        for c in children:
            if c.name in out:
                continue
            if not c.alive():
                raise RuntimeError(f"{c.name} failed before it was ready ({c.why()})")
            r = c.ready()
            if r:
                out[c.name] = r
        if time.monotonic() > deadline:
            missing = [c.name for c in children if c.name not in out]
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {', '.join(missing)}")
        time.sleep(0.1)
    return out


def stop_all(children: list[Child]) -> None:
    for c in reversed(children):  # gateway first, so no new work reaches the engines
        if c.alive():
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for c in children:
        left = max(0.1, deadline - time.monotonic())
        try:
            c.proc.wait(left)
        except subprocess.TimeoutExpired:
            print(f"splitserve: {c.name} did not stop in {GRACE_S:.0f} s; killing it", file=sys.stderr)
            c.proc.kill()
            c.proc.wait()
