"""Start real prefill, decode and gateway processes on free loopback ports for e2e tests.

All three export traces to an in-process OTLP receiver when one is given (batch delay
lowered so spans arrive within a fraction of a second)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "dummy:tiny-llama", "--dtype", "fp32", "--device", "cpu", "--max-model-len", "256",
        "--num-blocks", "64", "--enforce-eager"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready_path: str
    log_path: str
    ports: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()[-6000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, kill: bool = False) -> None:
        if self.popen.poll() is None:
            self.popen.kill() if kill else self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def _env(otlp_endpoint: str | None, service: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if otlp_endpoint:
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
                   OTEL_BSP_SCHEDULE_DELAY="100", OTEL_SERVICE_NAME=service)
    else:
        env["OTEL_TRACES_EXPORTER"] = "none"
    return env


def spawn(name: str, module: str, args: list[str], otlp_endpoint: str | None = None) -> Proc:
    d = tempfile.mkdtemp(prefix=f"e2e-{name}-")
    ready, log_path = os.path.join(d, "ready"), os.path.join(d, "log")
    cmd = [sys.executable, "-m", module, "--ready-file", ready, *args]
    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(otlp_endpoint, f"splitserve-{name}"),
                             stdout=logf, stderr=subprocess.STDOUT)
    return Proc(name, p, ready, log_path)


def wait_ready(procs: list[Proc], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pr in procs:
        while not pr.ports:
            if os.path.exists(pr.ready_path):
                pr.ports = [int(x) for x in Path(pr.ready_path).read_text().split()]
                break
            if not pr.alive():
                raise RuntimeError(f"{pr.name} exited {pr.popen.returncode}:\n{pr.log()}")
            if time.monotonic() > deadline:
                pr.stop(kill=True)
                raise TimeoutError(f"{pr.name} not ready in {timeout_s}s:\n{pr.log()}")
            time.sleep(0.05)


@dataclass
class Stack:
    prefills: list[Proc]
    decodes: list[Proc]
    gateway: Proc

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.gateway.ports[0]}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.ports[1]}"

    def all(self) -> list[Proc]:
        return [*self.prefills, *self.decodes, self.gateway]

    def stop(self) -> None:
        for p in [self.gateway, *self.prefills, *self.decodes]:
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {p.name}\n{p.log()}" for p in self.all())


def start_stack(engine_args: list[str] = TINY, *, n_prefill: int = 1, otlp_endpoint: str | None = None,
                gateway_args: list[str] = (), decode_args: list[str] = ()) -> Stack:
    model_args = engine_args[engine_args.index("--model"):engine_args.index("--model") + 2]
    mml = (["--max-model-len", engine_args[engine_args.index("--max-model-len") + 1]]
           if "--max-model-len" in engine_args else [])
    prefills = [spawn(f"prefill{i}" if n_prefill > 1 else "prefill", "prefill_svc",
                      ["--port", "0", "--metrics-port", "0", *engine_args], otlp_endpoint)
                for i in range(n_prefill)]
    decodes = [spawn("decode", "decode_svc", ["--port", "0", "--metrics-port", "0", *engine_args,
                                              *decode_args], otlp_endpoint)]
    try:
        wait_ready(prefills + decodes)
        gw = spawn("gateway", "gateway", [
            "--port", "0", "--http-port", "0", *model_args, *mml, "--poll-interval", "0.2",
            *[a for p in prefills for a in ("--prefill", p.address)],
            *[a for d in decodes for a in ("--decode", d.address)], *gateway_args], otlp_endpoint)
        wait_ready([gw])
    except BaseException:
        for p in prefills + decodes:
            p.stop(kill=True)
        raise
    return Stack(prefills, decodes, gw)
