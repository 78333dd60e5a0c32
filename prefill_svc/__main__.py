"""`python -m prefill_svc --model default --port 50061 --device cpu ...`"""
from __future__ import annotations

import argparse
import sys

from common.envs import env_float, env_int
from common.grpc_util import service_main
from common.service_args import add_engine_args, add_server_args, engine_config_from_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    add_server_args(p, default_port=50061)
    add_engine_args(p)
    p.add_argument("--kv-chunk-bytes", type=int,
                   default=env_int("SPLITSERVE_KV_CHUNK_BYTES", 2 * 1024 * 1024),
                   help="KV transfer chunk size (1-4 MiB is a good range)")
    p.add_argument("--transfer-timeout-s", type=float,
                   default=env_float("SPLITSERVE_TRANSFER_TIMEOUT_S", 30.0))
    return p.parse_args(argv)


async def amain(args) -> int:
    from common import runtime
    from engine.async_engine import AsyncEngine
    from kvtransfer.grpc_backend import GrpcKVSender
    from prefill_svc.servicer import SERVICE_NAME, PrefillServicer
    from protos import prefill_pb2_grpc

    cfg = engine_config_from_args(args, prefix_caching=True)
    runtime.setup_tracing("splitserve-prefill")
    engine = AsyncEngine(cfg)
    sender = GrpcKVSender(chunk_bytes=args.kv_chunk_bytes)

    def register(server):
        svc = PrefillServicer(engine, sender, runtime.get_metrics("prefill"), args.transfer_timeout_s)
        prefill_pb2_grpc.add_PrefillServicer_to_server(svc, server)
        return [SERVICE_NAME]

    return await runtime.serve("prefill", args, engine, register, on_stop=sender.close)


def main(argv=None) -> int:
    return service_main("prefill", parse_args, amain, argv)


if __name__ == "__main__":
    sys.exit(main())
