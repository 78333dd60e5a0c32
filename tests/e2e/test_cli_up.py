"""`splitserve up` starts the three services, prints working URLs, `splitserve generate`
streams through it, and SIGTERM stops all three processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.harness import ROOT, TINY_CPU, UP_PORTS, child_env, splitserve_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_up_generate_and_clean_shutdown():
    with splitserve_up([*UP_PORTS, *TINY_CPU]) as up:
        assert urllib.request.urlopen(up.rest + "/health", timeout=5).status == 200
        kids = _children(up.popen.pid)
        assert len(kids) == 3, up.log()
        out = subprocess.run([sys.executable, "-m", "splitserve_cli", "generate", "hi", "--server",
                              up.grpc_address, "--max-tokens", "4", "--stats"], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "4 completion tokens" in out.stderr
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(30) == 0, up.log()
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), "a service outlived `splitserve up`"
