"""Start the real prefill / decode service processes for tests (free loopback ports)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# SPLITSERVE_TEST_DEVICE=cuda runs the services on a GPU (CUDA graphs on); default cpu
DEVICE = os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu")  # use "cuda:0" (see service_args._device)
TINY = ["--model", "dummy:tiny-llama", "--dtype", "fp32", "--device", DEVICE, "--max-model-len", "256",
        "--num-blocks", "64", *(["--enforce-eager"] if DEVICE == "cpu" else [])]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int
    metrics_port: int
    log_path: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def spawn(module: str, extra: list[str] = ()):
    """Launch `python -m module` on free ports; -> (popen, ready path, log path)."""
    d = tempfile.mkdtemp(prefix=f"{module}-")
    ready, log_path = os.path.join(d, "ready"), os.path.join(d, "log")
    cmd = [sys.executable, "-m", module, "--port", "0", "--metrics-port", "0", "--ready-file", ready,
           *TINY, *extra]
    pp = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": pp, "OTEL_TRACES_EXPORTER": "none"}
    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
    return module, p, ready, log_path


def wait_ready(launch, timeout_s: float = 60.0) -> Proc:
    module, p, ready, log_path = launch
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(ready):
            port, mport = map(int, Path(ready).read_text().split())
            return Proc(module, p, port, mport, log_path)
        if p.poll() is not None:
            raise RuntimeError(f"{module} exited {p.returncode}:\n{Path(log_path).read_text()[-4000:]}")
        time.sleep(0.05)
    p.kill()
    raise TimeoutError(f"{module} not ready in {timeout_s}s:\n{Path(log_path).read_text()[-4000:]}")


def start(module: str, extra: list[str] = (), timeout_s: float = 60.0) -> Proc:
    return wait_ready(spawn(module, extra), timeout_s)


@contextlib.contextmanager
def service_pair(prefill_extra: list[str] = (), decode_extra: list[str] = ()):
    """A prefill and a decode service booted in parallel; -> (prefill Proc, decode Proc);
    both stopped on exit."""
    launches = [spawn("prefill_svc", prefill_extra), spawn("decode_svc", decode_extra)]
    try:
        yield tuple(wait_ready(ln) for ln in launches)
    finally:
        for _m, p, _r, _l in launches:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
