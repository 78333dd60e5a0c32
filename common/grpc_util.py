"""gRPC plumbing shared by the services: message-size / keepalive options, uvloop, health +
reflection registration, a serve-until-signal helper, error -> status mapping, and the port
check every service runs before it loads a model."""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.envs import env_int

log = logging.getLogger("splitserve.grpc")


def max_message_bytes() -> int:
    # KV chunks are 1-4 MiB; leave headroom for big prompts / batched responses.
    return env_int("SPLITSERVE_GRPC_MAX_MESSAGE_MB", 64) * 1024 * 1024


def channel_options() -> list[tuple[str, int]]:
    """Options for both servers and clients (the limits must agree on both ends)."""
    n = max_message_bytes()
    return [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
        # a peer silent 10 s is pinged and dropped when the ack has not come in grpc's ping
        # timeout (60 s): a service frozen for 20 s keeps its streams (the public front: 10 s)
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    return channel_options() + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),  # NOTE: two servers must never silently share one port
    ]


class PortInUseError(ValueError):
    """A port the process must bind is taken or unusable (found before the model loads)."""


def _bind_error(host: str, port: int) -> str | None:
    """Why host:port cannot be bound now (None: it can). Binds as the servers do (SO_REUSEADDR:
    a port in TIME_WAIT is free, one with a listener is not) and lets go at once."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve host {host!r}: {e.strerror}"
    errors = []
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return "is already in use"
                errors.append(e)
    # NOTE: an address family the host lacks (no IPv6 for "localhost") is not an error
    if errors and len(errors) == len(infos):
        return f"cannot be bound: {errors[0].strerror}"
    return None


def check_ports_free(host: str, ports) -> None:
    """Bind-test (label, port) pairs on host before anything slow starts; None, 0 (a free one)
    and negative (off) are skipped. Raises PortInUseError, one line naming the port and its use."""
    seen: dict[int, str] = {}
    for label, port in ports:
        if port is None or int(port) <= 0:
            continue
        port = int(port)
        if port in seen:
            raise PortInUseError(f"port {port} is given twice ({seen[port]} and {label})")
        seen[port] = label
        why = _bind_error(host, port)
        if why is not None:
            raise PortInUseError(f"port {port} ({label}) on {host} {why}")


def install_uvloop() -> bool:
    """Use uvloop for the process's event loops when available (returns whether it is)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in requirements
        log.warning("uvloop not installed; using the default asyncio loop")
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def run(main: Callable[[], Awaitable[int | None]]) -> int:
    """Run an async main on uvloop; returns its exit code."""
    install_uvloop()
    return asyncio.run(main()) or 0


def create_server(auth=None, interceptors=(), options=()) -> grpc.aio.Server:
    """auth: common.auth.InternalAuth of an internal service (its credentials are checked on
    every RPC but health), None for a public one; interceptors: more, after auth's; options:
    (name, value) pairs replacing or adding to server_options()."""
    icpt = [*(auth.server_interceptors() if auth is not None else ()), *interceptors]
    opts = dict(server_options())
    opts.update(options)
    return grpc.aio.server(options=list(opts.items()), interceptors=icpt or None)


def bind(server: grpc.aio.Server, host: str, port: int, auth=None) -> int:
    """Bind host:port (port 0 -> a free one); returns the bound port. auth: anything with
    add_port(server, address) (common.auth.InternalAuth, gateway.auth.PublicAuth: TLS)."""
    addr = f"{host}:{port}"
    bound = auth.add_port(server, addr) if auth is not None else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def open_channel(address: str, auth=None, options=None) -> grpc.aio.Channel:
    """A client channel to an internal service: with auth (common.auth.InternalAuth) every call
    carries its credentials; None: a plain insecure channel."""
    if auth is not None:
        return auth.channel(address, options)
    return grpc.aio.insecure_channel(address, options=options)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]
                              ) -> health.aio.HealthServicer:
    """Register grpc.health.v1 (all services start NOT_SERVING; call set_serving) and
    server reflection for the given full service names."""
    names = list(service_names)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], server)
    return hs


async def set_serving(hs: health.aio.HealthServicer, service_names: Iterable[str],
                      serving: bool) -> None:
    st = (health_pb2.HealthCheckResponse.SERVING if serving
          else health_pb2.HealthCheckResponse.NOT_SERVING)
    for n in ["", *service_names]:
        await hs.set(n, st)


async def wait_for_signal() -> None:
    """Return on SIGINT / SIGTERM."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, ev.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread
            pass
    await ev.wait()


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Map a known exception to its status and abort the RPC (always raises)."""
    code, msg = status_for(exc)
    await context.abort(code, msg)


def handler_like(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """A method handler of `handler`'s kind (unary / streaming request and response) and
    serializers around `behavior`: what an interceptor returns in place of the real one."""
    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(behavior, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behavior, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behavior, **kw)
    return grpc.stream_stream_rpc_method_handler(behavior, **kw)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    from engine.sampling_params import InvalidRequestError

    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def service_main(name: str, parse_args, amain, argv=None) -> int:
    """The shared `main()` of prefill_svc / decode_svc: parse flags (SPLITSERVE_* defaults are
    read and checked there), load the internal credentials (args.internal_auth), check the
    ports, set up logging, serve until stopped. Exit 2 on bad flags, missing credentials, a
    busy port or a model that cannot load (PortInUseError / ConfigError /
    ModelLoadError are ValueErrors)."""
    from common.log import setup_logging

    from common.auth import internal_auth_from_args

    try:
        args = parse_args(argv)
        args.internal_auth = internal_auth_from_args(args)  # no secret: refuse to start
        check_ports_free(args.host, [(f"{name} gRPC", args.port),
                                     (f"{name} metrics", getattr(args, "metrics_port", None))])
        setup_logging(args.log_level, name)
        return run(lambda: amain(args))
    except ValueError as e:
        print(f"{name}_svc: cannot start: {e}", file=sys.stderr)
        return 2


def freeze_heap() -> None:
    """After start-up: move every object alive now out of the collector's reach, so a full
    collection (tens of ms over a loaded model's objects) never lands between two tokens."""
    import gc

    gc.collect()
    gc.freeze()
