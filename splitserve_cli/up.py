"""`splitserve up`: prefill, decode and gateway as three processes (the gateway as several with
--gateway-workers), supervised together.

Starts prefill and decode (engine flags not known here are forwarded to both), waits for
their ready files, starts the gateway pointing at them, waits for it, prints the URLs.

Placement: `--prefill-gpu N --decode-gpu M` runs each service on its own GPU (`--device
cuda:N` / `cuda:M`); the KV transfer backend defaults to auto (vmm: decode maps prefill's
KV pool and copies device to device, on one GPU or across GPUs of the host).
`--kv-transfer-backend` sets it explicitly for both services.
Topology (`--topology`, splitserve_cli/up_topology.py): on a machine without a GPU the default
colocates (every prompt prefilled in the decode engine, which gets every core); `split` keeps
prefill and decode each on their own work.
Ctrl-C / SIGTERM -> graceful drain: SIGTERM to the gateway (running requests finish for up to
--drain-timeout-s), then to the services; SIGKILL to any still alive after that. A second
Ctrl-C cuts the drains short.
A child that dies once all are up is started again on its ports, with backoff
(splitserve_cli/supervise.py); past --max-restarts deaths in a row (or one, with 0), or a child
that fails before it is first ready, stops the others and `up` exits non-zero with one line
naming the child and why (the last error line of its stderr, which `up` passes through).
All ports given are bind-tested before anything starts.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

from kvtransfer.endpoint import BACKENDS as KV_BACKENDS
from common.metrics_export import MULTIPROC_ENV
from splitserve_cli.supervise import Supervisor, is_gateway, pin_flag, pinned_argv
from splitserve_cli.up_children import Child, service_cmd, stop_all, wait_ready
from splitserve_cli import up_topology
from splitserve_cli.up_banner import banner, gateway_front, gateway_shared_flags

WORKER_POLL_S = 0.1  # gateway workers' Load poll period (one gateway: its own default, 0.5 s)


class UpError(ValueError):
    """Flags that cannot work together (checked before anything starts)."""


def internal_secret_env(secret_file: str | None) -> dict[str, str]:
    """The children's internal credentials: the given secret file (checked here), else a fresh
    random secret for this run. Raises common.auth.AuthConfigError (a ValueError)."""
    from common.auth import ENV_SECRET, ENV_SECRET_FILE, generate_secret, read_secret_file

    if secret_file:
        read_secret_file(secret_file)
        return {ENV_SECRET_FILE: secret_file}
    return {ENV_SECRET: generate_secret()}


def gateway_workers_env(env: dict, tmp: str, workers: int) -> dict:
    """The gateway's environment: with several workers, the directory where each writes its
    metric values (common/metrics_export.py) so that a scrape of any of them shows all."""
    if workers <= 1:
        return env
    path = os.path.join(tmp, "gateway-metrics")
    os.makedirs(path, exist_ok=True)
    return {**env, MULTIPROC_ENV: path}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("SPLITSERVE_MODEL", "default"))
    p.add_argument("--host", default="127.0.0.1", help="bind address of all three services")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50071)
    p.add_argument("--metrics-ports", default=os.environ.get("SPLITSERVE_METRICS_PORTS", "9101,9102"),
                   help="prefill,decode Prometheus /metrics ports (0: a free one; 'off': none; "
                        "default 9101,9102; SPLITSERVE_METRICS_PORTS)")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra flag for the gateway only (repeat), e.g. --gateway-arg=--default-ttft-ms=500")
    p.add_argument("--prefill-arg", action="append", default=[],
                   help="extra flag for prefill only (repeat), e.g. --prefill-arg=--kv-chunk-bytes=8388608")
    p.add_argument("--decode-arg", action="append", default=[],
                   help="extra flag for decode only (repeat), e.g. --decode-arg=--prefill-yield-ratio=0")
    p.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                   help="gateway processes sharing the gRPC and REST ports (SO_REUSEPORT: the "
                        "kernel spreads connections); more than one when the gateway's CPU "
                        "limits the token rate (many fast streams). Each admits on its own "
                        "requests and the replicas' polled load; /metrics sums them all")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="Ctrl-C / SIGTERM: running requests may finish for this long (each service)")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="a child that dies is restarted with backoff; after this many deaths in a "
                        "row (without a minute up) everything stops (0: stop at the first; -1: "
                        "no limit)")
    p.add_argument("--internal-secret-file", default=os.environ.get("SPLITSERVE_INTERNAL_SECRET_FILE"),
                   help="shared secret of the internal RPCs (a 0600 file); default: a random one "
                        "per run, passed to the three services in their environment")
    p.add_argument("--log-level", default=None)
    p.add_argument("--prefill-gpu", type=int, default=None, metavar="N",
                   help="run prefill on cuda:N (with --decode-gpu)")
    p.add_argument("--decode-gpu", type=int, default=None, metavar="M",
                   help="run decode on cuda:M (with --prefill-gpu)")
    p.add_argument("--kv-transfer-backend", choices=KV_BACKENDS, default=None,
                   help="KV transfer between prefill and decode (SPLITSERVE_KV_TRANSFER_BACKEND); "
                        "default: auto (vmm / shm on one host, else grpc)")
    p.add_argument("--topology", choices=up_topology.TOPOLOGIES, default="auto",
                   help="colocated: every prompt prefilled in the decode engine, which uses every "
                        "core (the prefill service idles); split: prefill and decode engines each "
                        "on their own work (on CPU, half the cores each); auto (default): "
                        "colocated without a GPU, else split")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def placement(a: argparse.Namespace, engine_args: list[str], cuda_count: int | None = None
              ) -> tuple[dict[str, list[str]], str | None]:
    """-> (extra flags per service, KV backend or None for the services' default).
    Raises UpError for flags that cannot work (cuda_count: GPUs seen; None -> ask torch)."""
    from common.envs import env_str

    extra: dict[str, list[str]] = {"prefill": [], "decode": []}
    backend = a.kv_transfer_backend or env_str("SPLITSERVE_KV_TRANSFER_BACKEND")
    if backend is not None and backend not in KV_BACKENDS:
        raise UpError(f"SPLITSERVE_KV_TRANSFER_BACKEND={backend!r}: use one of {', '.join(KV_BACKENDS)}")
    gpus = {"prefill": a.prefill_gpu, "decode": a.decode_gpu}
    if all(g is None for g in gpus.values()):
        return extra, backend
    if any(g is None for g in gpus.values()):
        raise UpError("--prefill-gpu and --decode-gpu go together (each service gets its own device)")
    if any(x == "--device" or x.startswith("--device=") for x in engine_args):
        raise UpError("--device conflicts with --prefill-gpu / --decode-gpu (they set each service's device)")
    n = _cuda_count() if cuda_count is None else cuda_count
    if n == 0:
        raise UpError("--prefill-gpu / --decode-gpu need CUDA, but torch sees no GPU on this machine "
                      "(drop the flags to run on CPU)")
    for name, g in gpus.items():
        if not 0 <= g < n:
            raise UpError(f"--{name}-gpu {g}: this machine has {n} GPU(s) (0..{n - 1})")
    same = gpus["prefill"] == gpus["decode"]
    if backend == "dist" and same:
        raise UpError(f"--kv-transfer-backend dist with prefill and decode both on GPU {gpus['prefill']}: "
                      "NCCL cannot pair two ranks on one GPU; use two GPUs or --kv-transfer-backend auto")
    for name, g in gpus.items():
        extra[name] += ["--device", f"cuda:{g}"]
    return extra, backend


def run_up(a: argparse.Namespace, engine_args: list[str]) -> int:
    try:
        extra, backend = placement(a, engine_args)
    except UpError as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return 2
    if backend is not None:
        for flags in extra.values():
            flags += ["--kv-transfer-backend", backend]
    a.resolved_topology = up_topology.resolve(
        a.topology, engine_args, a.prefill_gpu is not None or a.decode_gpu is not None, _cuda_count)
    gw_topology: list[str] = []
    if a.resolved_topology == "colocated":
        more, gw_topology = up_topology.colocated_flags(engine_args, a.gateway_arg,
                                                        up_topology.usable_cores())
        for name, flags in more.items():
            extra[name] += flags
    a.decode_threads = (up_topology.flag_value("--cpu-threads", extra["decode"] + engine_args)
                        or os.environ.get("SPLITSERVE_CPU_THREADS") or "default")
    from common.grpc_util import PortInUseError, check_ports_free

    off = not a.metrics_ports or a.metrics_ports.strip().lower() == "off"
    mp = [None, None] if off else a.metrics_ports.split(",")
    if len(mp) != 2 or not all(x is None or x.strip().isdigit() for x in mp):
        print(f"splitserve up: --metrics-ports takes two ports, prefill,decode (e.g. 9101,9102), or off; "
              f"got {a.metrics_ports!r}", file=sys.stderr)
        return 2
    try:
        check_ports_free(a.host, [("gateway REST", a.http_port), ("gateway gRPC", a.grpc_port),
                                  ("prefill gRPC", a.prefill_port), ("decode gRPC", a.decode_port),
                                  ("prefill metrics", mp[0]), ("decode metrics", mp[1])])
    except PortInUseError as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return 2
    if a.gateway_workers < 1:
        print(f"splitserve up: --gateway-workers must be >= 1, got {a.gateway_workers}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="splitserve-up-")
    try:  # NOTE: the secret goes in the children's environment, never on a command line (ps)
        env = {**os.environ, **internal_secret_env(a.internal_secret_file)}
    except ValueError as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return 2
    env.pop(MULTIPROC_ENV, None)  # NOTE: one service's workers share a directory, never two services
    gw_env = gateway_workers_env(env, tmp, a.gateway_workers)
    common = ["--model", a.model, "--host", a.host, "--drain-timeout-s", str(a.drain_timeout_s)] + (
        ["--log-level", a.log_level] if a.log_level else [])
    children: list[Child] = []
    sup: Supervisor | None = None
    failure: str | None = None
    stop = {"sig": None}

    def on_signal(signum, _frame):
        if stop["sig"] is not None and sup is not None:  # a second Ctrl-C cuts the drains short
            for c in sup.children:
                if c.alive():
                    c.proc.send_signal(signal.SIGTERM)
        stop["sig"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name, module, port, mport in (("prefill", "prefill_svc", a.prefill_port, mp[0]),
                                          ("decode", "decode_svc", a.decode_port, mp[1])):
            args = common + ["--port", str(port), "--ready-file", os.path.join(tmp, name)]
            if mport:
                args += ["--metrics-port", mport]
            args += extra[name]
            own = a.prefill_arg if name == "prefill" else a.decode_arg  # last: they win
            children.append(Child(name, service_cmd(module, args + engine_args + own),
                                  os.path.join(tmp, name), env))
        ready = wait_ready(children, a.ready_timeout)
        pport, dport = ready["prefill"][0], ready["decode"][0]
        shared = gateway_shared_flags(engine_args)
        gw_args = common + ["--port", str(a.grpc_port), "--http-port", str(a.http_port),
                            "--prefill", f"{a.host}:{pport}", "--decode", f"{a.host}:{dport}",
                            "--ready-file", os.path.join(tmp, "gateway"), *shared, *gw_topology,
                            *a.gateway_arg]
        if a.gateway_workers > 1:
            gw_args += ["--reuse-port", "--workers", str(a.gateway_workers), "--worker-index", "0",
                        "--worker-board", os.path.join(tmp, "gateway-board")]
            if not any(x.startswith("--poll-interval") for x in a.gateway_arg):
                # NOTE: a worker sees its siblings' requests only in the replicas' Load: poll
                # 5x as often as one gateway does, to keep that blind window short
                gw_args += ["--poll-interval", str(WORKER_POLL_S)]
        children.append(Child("gateway", service_cmd("gateway", gw_args), os.path.join(tmp, "gateway"),
                              gw_env))
        ready = wait_ready(children, a.ready_timeout)
        gport, hport = ready["gateway"][0], ready["gateway"][1]
        for i in range(1, a.gateway_workers):  # on the ports the first one bound (0: a free one)
            name = f"gateway-{i}"
            argv = pin_flag(pin_flag(gw_args, "--ready-file", os.path.join(tmp, name)),
                            "--worker-index", str(i))
            argv = pinned_argv("gateway", argv, ready["gateway"])
            children.append(Child(name, service_cmd("gateway", argv), os.path.join(tmp, name), gw_env))
        ready = wait_ready(children, a.ready_timeout)
        print(banner(a, engine_args, backend, gport, hport, pport, dport,
                     (ready["prefill"][1], ready["decode"][1]), gateway_front(gw_args)), flush=True)
        def respawn(name: str, argv: list[str], ready_file: str, restarts: int) -> Child:
            gw = is_gateway(name)
            if gw and MULTIPROC_ENV in gw_env:  # its live gauges leave the sums
                from prometheus_client.multiprocess import mark_process_dead

                mark_process_dead(sup.slots[name].child.proc.pid, gw_env[MULTIPROC_ENV])
            return Child(name, argv, ready_file, {**(gw_env if gw else env),
                                                  "SPLITSERVE_RESTARTS": str(restarts)})

        sup = Supervisor(children, ready, respawn,
                         max_restarts=a.max_restarts, drain_timeout_s=a.drain_timeout_s)
        failure = sup.run(stop)
        return 1 if failure else 0
    except RuntimeError as e:
        failure = str(e)
        return 1
    finally:
        if sup is not None:
            sup.stop_all()
        else:
            stop_all(children)
        if failure:  # NOTE: last, below the other children's shutdown logs
            print(f"splitserve up: {failure}", file=sys.stderr, flush=True)
