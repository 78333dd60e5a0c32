"""Gateway process: public gRPC (Generation + health + reflection) and the REST bridge on one
event loop, sharing one GatewayCore. `python -m gateway --prefill H:P --decode H:P`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from common import telemetry
from common.envs import env_int
from common.log import setup_logging
from common.metrics import get_metrics
from gateway.config import GatewayConfig, add_args, config_from_args
from gateway.auth import PublicAuth
from gateway.core import GatewayCore
from gateway.routing import ReplicaPool

log = logging.getLogger("splitserve.gateway")
SERVICE = "splitserve.v1.Generation"


def load_model_meta(cfg: GatewayConfig) -> dict:
    """Tokenizer + shape of the served model, without touching its weights."""
    import torch

    from engine.config import ModelConfig
    from engine.loader import load_model

    lm = load_model(ModelConfig(model=cfg.model), "cpu", torch.float32)
    close = getattr(lm.weights, "close", None)
    if close is not None:
        close()  # NOTE: the weights iterator is lazy; closing it never reads a tensor
    arch = lm.arch
    return {"tokenizer": lm.tokenizer, "name": cfg.served_model_name or lm.name,
            "max_model_len": cfg.max_model_len or arch.max_position_embeddings,
            "vocab_size": arch.vocab_size,
            "eos_token_ids": tuple(arch.eos_token_ids) or tuple(getattr(lm.tokenizer, "eos_token_ids", ())),
            "info": {"arch": arch.arch, "num_layers": arch.num_layers}}


def build_core(cfg: GatewayConfig, meta: dict) -> GatewayCore:
    from protos import decode_pb2_grpc, prefill_pb2_grpc

    core_ref: list[GatewayCore] = []

    def on_update():
        if core_ref:
            core_ref[0].queue.notify()

    metrics = get_metrics("gateway", meta["name"])
    metrics.restarts.set(env_int("SPLITSERVE_RESTARTS", 0))  # set by `up` when it restarts us
    prefill = ReplicaPool("prefill", list(cfg.prefill), prefill_pb2_grpc.PrefillStub, on_update, metrics,
                          auth=cfg.internal_auth)
    decode = ReplicaPool("decode", list(cfg.decode), decode_pb2_grpc.DecodeStub, on_update, metrics,
                         auth=cfg.internal_auth)
    core = GatewayCore(model_name=meta["name"], tokenizer=meta["tokenizer"],
                       max_model_len=meta["max_model_len"], vocab_size=meta["vocab_size"],
                       eos_token_ids=meta["eos_token_ids"], prefill=prefill, decode=decode,
                       admission=cfg.admission, metrics=metrics, info=meta["info"],
                       transfer_timeout_ms=cfg.transfer_timeout_ms,
                       prefill_on_decode=cfg.prefill_on_decode, decode_streams=cfg.decode_streams,
                       reserve_overlap=cfg.reserve_overlap)
    core_ref.append(core)
    if cfg.worker_board:
        from gateway.clock_board import ClockBoard

        reps = [*prefill.replicas, *decode.replicas]
        board = ClockBoard(cfg.worker_board, cfg.workers, cfg.worker_index, len(reps))
        for i, r in enumerate(reps):
            r.clock.peers = board.view(i)
    return core


def public_grpc_options(cfg: GatewayConfig) -> list[tuple[str, int]]:
    """Limits of the public gRPC front against hostile clients (the internal plane keeps
    common.grpc_util.server_options: its KV chunks need the large messages)."""
    return [
        ("grpc.so_reuseport", 1 if cfg.reuse_port else 0),
        # a message is a prompt (text <= max_body_bytes) and its fields: a larger one is refused
        # by its length prefix, before it is buffered
        ("grpc.max_receive_message_length", cfg.max_body_bytes + (1 << 20)),
        ("grpc.max_concurrent_streams", cfg.grpc_max_streams_per_connection),
        # request metadata beyond this is refused (a few keys, a bearer token, a traceparent)
        ("grpc.max_metadata_size", 16 << 10),
        # a connection that has not finished its HTTP/2 (and TLS) handshake by then is closed
        ("grpc.server_handshake_timeout_ms", 10_000),
        # a client that stops answering keepalive pings (frozen, gone without a FIN) is dropped
        # and its calls cancelled ~20 s on; without it the ping waits 60 s for its ack
        ("grpc.http2.ping_timeout_ms", 10_000),
    ]


async def serve(cfg: GatewayConfig) -> int:
    from common import grpc_util
    from gateway.grpc_server import add_to_server

    telemetry.setup_tracing("splitserve-gateway")
    meta = await asyncio.to_thread(load_model_meta, cfg)
    core = build_core(cfg, meta)
    front = PublicAuth.create(cfg.api_keys, cfg.tls_cert, cfg.tls_key, cfg.max_concurrency_per_key)
    server = grpc_util.create_server(interceptors=front.grpc_interceptors(),
                                     options=public_grpc_options(cfg))
    add_to_server(server, core, cfg.default_max_tokens, cfg.max_tokens_over_context,
                  cfg.max_body_bytes)
    hs = grpc_util.add_health_and_reflection(server, [SERVICE])
    grpc_port = grpc_util.bind(server, cfg.host, cfg.grpc_port, front)
    await server.start()
    await core.prefill.poll_once()
    await core.decode.poll_once()
    core.prefill.start(cfg.poll_interval_s)
    core.decode.start(cfg.poll_interval_s)
    await grpc_util.set_serving(hs, [SERVICE], True)

    http_server, http_task, http_port = None, None, -1
    if cfg.http_port >= 0:
        import socket

        import uvicorn

        from gateway.rest import build_app

        app = build_app(core, default_max_tokens=cfg.default_max_tokens,
                        max_body_bytes=cfg.max_body_bytes,
                        max_tokens_over_context=cfg.max_tokens_over_context)
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cfg.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((cfg.host, cfg.http_port))  # bind here so port 0 is known before serving
        http_port = sock.getsockname()[1]
        ucfg = uvicorn.Config(front.wrap_asgi(app), log_level="warning", access_log=False,
                              lifespan="off", **front.uvicorn_ssl())
        http_server = uvicorn.Server(ucfg)
        http_server.install_signal_handlers = lambda: None  # NOTE: we own SIGINT/SIGTERM
        http_task = asyncio.get_running_loop().create_task(http_server.serve(sockets=[sock]))
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.02)
        if http_task.done():
            http_task.result()
    log.info("gateway: model=%s gRPC %s:%d REST %s; prefill=%s decode=%s", core.model_name,
             cfg.host, grpc_port, f"http://{cfg.host}:{http_port}" if http_port >= 0 else "off",
             ",".join(cfg.prefill), ",".join(cfg.decode))
    grpc_util.freeze_heap()
    if cfg.ready_file:
        import os

        tmp = cfg.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{grpc_port} {http_port}\n")
        os.replace(tmp, cfg.ready_file)
    watch = asyncio.get_running_loop().create_task(_health_watch(core, hs))
    try:
        await grpc_util.wait_for_signal()
    finally:
        watch.cancel()
        left = await drain(core, hs, cfg.drain_timeout_s)
        if http_server is not None:
            http_server.should_exit = True
            await asyncio.wait([http_task], timeout=max(0.5, left / 2))
        await server.stop(grace=max(0.2, left / 2))
        await core.prefill.close()
        await core.decode.close()
        telemetry.shutdown_tracing()
    return 0


async def _health_watch(core: GatewayCore, hs, interval_s: float = 0.25) -> None:
    """gRPC health follows /health: SERVING while a prefill and a decode replica are up."""
    from common import grpc_util

    serving = True
    while True:
        await asyncio.sleep(interval_s)
        ok = core.replicas_up()
        if ok != serving and not core.draining:
            serving = ok
            await grpc_util.set_serving(hs, [SERVICE], ok)


async def drain(core: GatewayCore, hs, timeout_s: float) -> float:
    """Graceful stop: health NOT_SERVING first, new requests refused (UNAVAILABLE / 503 with
    Retry-After), running ones finish for up to timeout_s (a second signal cuts it short).
    -> seconds left of timeout_s for closing the servers."""
    from common import grpc_util

    t0 = time.monotonic()
    log.info("gateway draining: %d request(s) running, up to %.0f s", core.num_active, timeout_s)
    core.start_drain()
    await grpc_util.set_serving(hs, [SERVICE], False)
    # NOTE: closing the servers takes a moment too: keep ~10% (at most 1 s) of the budget for it
    budget = max(0.0, timeout_s - min(1.0, timeout_s * 0.1))
    idle = asyncio.ensure_future(core.wait_idle(budget))
    again = asyncio.ensure_future(grpc_util.wait_for_signal())
    await asyncio.wait([idle, again], return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if not idle.done():
        idle.cancel()
        log.warning("gateway: second signal, stopping with %d request(s) running", core.num_active)
    elif not idle.result():
        log.warning("gateway: drain timeout (%.0f s), %d request(s) cut", timeout_s, core.num_active)
    else:
        log.info("gateway drained in %.1f s", time.monotonic() - t0)
    return max(0.0, timeout_s - (time.monotonic() - t0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_args(p)
    a = p.parse_args(argv)
    setup_logging(a.log_level, "gateway")
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    from common.grpc_util import run

    return run(lambda: serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
