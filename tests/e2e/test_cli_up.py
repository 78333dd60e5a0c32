"""`splitserve up` starts the three services, prints working URLs, `splitserve generate`
streams through it, and SIGTERM stops all three processes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.harness import ROOT

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


def test_up_generate_and_clean_shutdown(tmp_path):
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OTEL_TRACES_EXPORTER": "none"}
    with open(log, "w") as f:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli", "up", "--model", "dummy:tiny-llama",
             "--http-port", "0", "--grpc-port", "0", "--prefill-port", "0", "--decode-port", "0",
             "--device", "cpu", "--dtype", "fp32", "--num-blocks", "64", "--max-model-len", "256",
             "--enforce-eager"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "is up" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        rest = re.search(r"REST \(OpenAI\)\s+(http://\S+)/v1", text).group(1)
        grpc_addr = re.search(r"gRPC\s+(\S+:\d+)", text).group(1)
        assert urllib.request.urlopen(rest + "/health", timeout=5).status == 200
        kids = _children(up.pid)
        assert len(kids) == 3, text
        out = subprocess.run([sys.executable, "-m", "splitserve_cli", "generate", "hi", "--server",
                              grpc_addr, "--max-tokens", "4", "--stats"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "4 completion tokens" in out.stderr
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0, log.read_text()
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), "a service outlived `splitserve up`"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
