"""Real service processes for the tests (tests/services, tests/e2e, tests/kvtransfer): each on
free loopback ports, found through its --ready-file, its output kept in a log file.

    with service_pair(prefill_extra, decode_extra) as (pre, dec): ...   # prefill_svc + decode_svc
    with service_group(a=("decode_svc", extra), ...) as procs: ...       # any set, in parallel
    stack = start_stack(TINY_CPU, n_prefill=2, otlp_endpoint=...)       # + a gateway in front
    with splitserve_up([*UP_PORTS, *TINY_CPU]) as up: ...                # `splitserve up`, banner read

Traces go to an OTLP receiver when one is given (batch delay lowered so spans arrive within
a fraction of a second), nowhere otherwise.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.system_procs import stop_process, wait_up

ROOT = Path(__file__).resolve().parents[1]
# SPLITSERVE_TEST_DEVICE=cuda runs the services on a GPU (CUDA graphs on); default cpu
DEVICE = os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu")  # use "cuda:0" (see service_args._device)


def tiny_args(device: str) -> list[str]:
    """Engine flags of the small dummy model every service test runs."""
    return ["--model", "dummy:tiny-llama", "--dtype", "fp32", "--device", device,
            "--max-model-len", "256", "--num-blocks", "64",
            *(["--enforce-eager"] if device == "cpu" else [])]


TINY = tiny_args(DEVICE)  # prefill / decode service tests: on the test device
TINY_CPU = tiny_args("cpu")  # the three-process stacks run on the CPU


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready_path: str
    log_path: str
    ports: list[int] = field(default_factory=list)  # from the ready file: grpc, then metrics / http

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def metrics_port(self) -> int:
        return self.ports[1]

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

    def wait_ready(self, timeout_s: float = 60.0, deadline: float | None = None) -> "Proc":
        """Until the ready file names the ports; a process that exits or stays silent past the
        deadline raises with its log (and is killed)."""
        deadline = deadline if deadline is not None else time.monotonic() + timeout_s
        while not self.ports:
            if os.path.exists(self.ready_path):
                self.ports = [int(x) for x in Path(self.ready_path).read_text().split()]
                break
            if not self.alive():
                raise RuntimeError(f"{self.name} exited {self.popen.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise TimeoutError(f"{self.name} not ready in {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)
        return self


def child_env(otlp_endpoint: str | None = None, service: str = "splitserve") -> dict:
    """The environment of a child process: this checkout importable, traces off unless an OTLP
    endpoint is given."""
    pp = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # NOTE: services the tests start directly serve an open internal plane unless given
    # --internal-secret-file (tests/services/test_auth*.py); `splitserve up` passes its own secret
    env = {"SPLITSERVE_INSECURE_INTERNAL": "1", **os.environ, "PYTHONPATH": pp}
    if otlp_endpoint:
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
                   OTEL_BSP_SCHEDULE_DELAY="100", OTEL_SERVICE_NAME=service)
    else:
        env["OTEL_TRACES_EXPORTER"] = "none"
    return env


def spawn(name: str, module: str, args: list[str], otlp_endpoint: str | None = None) -> Proc:
    """Launch `python -m module --ready-file ... args`; returns at once (call wait_ready)."""
    d = tempfile.mkdtemp(prefix=f"{name}-")
    ready, log_path = os.path.join(d, "ready"), os.path.join(d, "log")
    cmd = [sys.executable, "-m", module, "--ready-file", ready, *args]
    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, cwd=ROOT, env=child_env(otlp_endpoint, f"splitserve-{name}"),
                             stdout=logf, stderr=subprocess.STDOUT)
    return Proc(name, p, ready, log_path)


def wait_all(procs, timeout_s: float = 60.0) -> list[Proc]:
    """wait_ready for several processes booting in parallel, under one deadline."""
    deadline = time.monotonic() + timeout_s
    return [p.wait_ready(timeout_s, deadline) for p in procs]


def spawn_service(module: str, extra: list[str] = ()) -> Proc:
    """prefill_svc / decode_svc with the tiny model on free ports (+ a metrics port)."""
    return spawn(module, module, ["--port", "0", "--metrics-port", "0", *TINY, *extra])


def start_service(module: str, extra: list[str] = (), timeout_s: float = 60.0) -> Proc:
    return spawn_service(module, extra).wait_ready(timeout_s)


@contextlib.contextmanager
def gateway_over_fakes(fake_args: list[str], gateway_args: list[str]):
    """The fake prefill / decode process (tests.gateway.fake_backends) and a gateway in front
    of it (tiny-llama, gRPC on a free port); -> (gateway Proc, fake decode's address); the
    gateway must still be alive at exit."""
    fakes = spawn("fakes", "tests.gateway.fake_backends", fake_args)
    gw = None
    try:
        fakes.wait_ready(60)
        decode = f"127.0.0.1:{fakes.ports[1]}"
        gw = spawn("gateway", "gateway", [
            "--port", "0", "--model", "dummy:tiny-llama", "--poll-interval", "0.2",
            "--prefill", fakes.address, "--decode", decode, *gateway_args])
        gw.wait_ready(120)
        yield gw, decode
        assert gw.alive(), gw.log()
    finally:
        if gw is not None:
            gw.stop()
        fakes.stop()


@contextlib.contextmanager
def service_group(**specs: tuple[str, list[str]]):
    """name=(module, extra flags) services booted in parallel; -> {name: Proc}; all stopped
    on exit."""
    procs = {k: spawn_service(m, extra) for k, (m, extra) in specs.items()}
    try:
        wait_all(procs.values())
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@contextlib.contextmanager
def service_pair(prefill_extra: list[str] = (), decode_extra: list[str] = ()):
    """A prefill and a decode service booted in parallel; -> (prefill Proc, decode Proc)."""
    with service_group(prefill=("prefill_svc", prefill_extra),
                       decode=("decode_svc", decode_extra)) as procs:
        yield procs["prefill"], procs["decode"]


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


def start_stack(engine_args: list[str] = TINY_CPU, *, n_prefill: int = 1,
                otlp_endpoint: str | None = None, gateway_args: list[str] = (),
                decode_args: list[str] = ()) -> Stack:
    """n_prefill prefill replicas and one decode, then a gateway routing to them."""
    model_args = engine_args[engine_args.index("--model"):engine_args.index("--model") + 2]
    mml = (["--max-model-len", engine_args[engine_args.index("--max-model-len") + 1]]
           if "--max-model-len" in engine_args else [])
    prefills = [spawn(f"prefill{i}" if n_prefill > 1 else "prefill", "prefill_svc",
                      ["--port", "0", "--metrics-port", "0", *engine_args], otlp_endpoint)
                for i in range(n_prefill)]
    decodes = [spawn("decode", "decode_svc", ["--port", "0", "--metrics-port", "0", *engine_args,
                                              *decode_args], otlp_endpoint)]
    try:
        wait_all(prefills + decodes, 120.0)
        gw = spawn("gateway", "gateway", [
            "--port", "0", "--http-port", "0", *model_args, *mml, "--poll-interval", "0.2",
            *[a for p in prefills for a in ("--prefill", p.address)],
            *[a for d in decodes for a in ("--decode", d.address)], *gateway_args], otlp_endpoint)
        gw.wait_ready(120.0)
    except BaseException:
        for p in prefills + decodes:
            p.stop(kill=True)
        raise
    return Stack(prefills, decodes, gw)


# ---- `splitserve up` ---------------------------------------------------------------------------

UP_PORTS = ["--http-port", "0", "--grpc-port", "0", "--prefill-port", "0", "--decode-port", "0",
            "--metrics-ports", "0,0"]


@dataclass
class Up:
    """A running `splitserve up`; rest (base URL, without /v1) and grpc_address from its banner."""
    popen: subprocess.Popen
    log_path: str
    rest: str = ""
    grpc_address: str = ""

    def log(self) -> str:
        return Path(self.log_path).read_text()


@contextlib.contextmanager
def splitserve_up(args: list[str], *, cmd: list[str] | None = None, cwd=ROOT, env: dict | None = None,
                  timeout_s: float = 120.0, ssl_context=None):
    """`splitserve up ARGS` (cmd: how to run `splitserve`, default this checkout's
    `python -m splitserve_cli`), its output in a log file; -> an Up once the banner is printed
    and the gateway answers /health (ssl_context: trust for an https front); on exit SIGTERM
    (SIGKILL after 30 s) if it still runs."""
    log_path = os.path.join(tempfile.mkdtemp(prefix="up-"), "log")
    with open(log_path, "w") as f:
        p = subprocess.Popen([*(cmd or [sys.executable, "-m", "splitserve_cli"]), "up", *args],
                             cwd=cwd, env=env if env is not None else child_env(), stdout=f,
                             stderr=subprocess.STDOUT)
    up = Up(p, log_path)
    try:
        try:
            up.rest, up.grpc_address = wait_up(p, log_path, timeout_s, ssl_context)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{up.log()[-6000:]}") from None
        yield up
    finally:
        stop_process(p, 30)
