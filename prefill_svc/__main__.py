"""`python -m prefill_svc --model default --port 50061 --device cpu ...`"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from common.envs import env_float, env_int
from common.grpc_util import service_main
from common.service_args import (add_engine_args, add_kv_transfer_args, add_server_args,
                                 engine_config_from_args, kv_backend_from_args, pair_host)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    add_server_args(p, default_port=50061)
    add_engine_args(p)
    add_kv_transfer_args(p)
    p.add_argument("--kv-chunk-bytes", type=int,
                   default=env_int("SPLITSERVE_KV_CHUNK_BYTES", 2 * 1024 * 1024),
                   help="KV transfer chunk size (1-4 MiB is a good range)")
    p.add_argument("--transfer-timeout-s", type=float,
                   default=env_float("SPLITSERVE_TRANSFER_TIMEOUT_S", 30.0),
                   help="fail a request whose KV is not acked by decode in this time")
    p.add_argument("--kv-nixl-staging-mb", type=int, default=256,
                   help="nixl: registered staging buffer for outgoing layers (MiB)")
    return p.parse_args(argv)


async def amain(args) -> int:
    from common import runtime, telemetry
    from common.metrics import get_metrics
    from engine.async_engine import AsyncEngine
    from kvtransfer import KVLayout
    from kvtransfer.backends.grpc import GrpcKVSender
    from kvtransfer.endpoint import (BACKENDS, backend_unavailable, device_id, local_endpoint,
                                     pool_backend_for)
    from prefill_svc.kv_push import KVPusher
    from prefill_svc.servicer import SERVICE_NAME, PrefillServicer
    from protos import prefill_pb2_grpc

    backend = kv_backend_from_args(args, BACKENDS, backend_unavailable)
    cfg = engine_config_from_args(args, prefix_caching=True)
    if _wants_shared_pool(backend, args.device):  # decode peers on this host map it
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, shareable=True))
    telemetry.setup_tracing("splitserve-prefill")
    engine = AsyncEngine(cfg)
    holder = {}

    def register(server):
        info = engine.info()
        layout = KVLayout(num_layers=info["num_layers"], num_kv_heads=info["num_kv_heads"],
                          head_dim=info["head_dim"], dtype=info["kv_dtype"], block_size=info["block_size"])
        local = local_endpoint(info["device"])
        auth = args.internal_auth  # every channel to decode carries the internal credentials
        senders = {"grpc": GrpcKVSender(chunk_bytes=args.kv_chunk_bytes, auth=auth)}
        pair_kw = dict(op_timeout_s=args.kv_pair_timeout_s, connect_timeout_s=args.kv_pair_timeout_s,
                       auth=auth)
        if backend == "dist":
            from kvtransfer.backends.dist import DistKVSender

            senders["dist"] = DistKVSender(local, host=pair_host(args.host), **pair_kw)
        elif backend == "nixl":
            from kvtransfer.backends.nixl_sender import NixlKVSender

            senders["nixl"] = NixlKVSender(local, staging_bytes=args.kv_nixl_staging_mb << 20, **pair_kw)
        pool = engine.kv_pool()
        if pool.shareable:
            from kvtransfer.backends.pool_sender import PoolKVSender
            from kvtransfer.backends.pool_share import PoolServer

            server_info = {"num_layers": info["num_layers"], "num_blocks": info["num_blocks"],
                           "block_bytes": layout.layer_nbytes(1) // 2,
                           "device_id": device_id(local)}  # decode yields to a prefill on its device
            name = pool_backend_for(info["device"])
            senders[name] = PoolKVSender(PoolServer(pool, server_info), name, auth=auth)
        metrics = get_metrics("prefill")
        pusher = holder["pusher"] = KVPusher(senders, backend, local, layout, metrics,
                                             args.transfer_timeout_s)
        svc = holder["svc"] = PrefillServicer(engine, pusher, metrics, auth)
        prefill_pb2_grpc.add_PrefillServicer_to_server(svc, server)
        return [SERVICE_NAME]

    return await runtime.serve("prefill", args, engine, register,
                               on_stop=lambda: holder["pusher"].close(),
                               busy=lambda: holder["svc"].in_flight)


def _wants_shared_pool(backend: str, device: str) -> bool:
    """auto: a shareable pool where this host can share it (vmm needs cuda-bindings)."""
    from kvtransfer.endpoint import POOL_BACKENDS, backend_unavailable

    if backend in POOL_BACKENDS:
        return True
    if backend != "auto":
        return False
    import torch

    cuda = torch.cuda.is_available() if device in ("auto", "", None) else device.startswith("cuda")
    return not cuda or backend_unavailable("vmm") is None


def main(argv=None) -> int:
    return service_main("prefill", parse_args, amain, argv)


if __name__ == "__main__":
    sys.exit(main())
