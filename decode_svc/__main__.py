"""`python -m decode_svc --model default --port 50071 --device cpu ...`"""
from __future__ import annotations

import argparse
import sys

from common.envs import env_float, env_str
from common.grpc_util import service_main
from common.service_args import add_engine_args, add_server_args, engine_config_from_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    add_server_args(p, default_port=50071)
    add_engine_args(p)
    p.add_argument("--advertise-address", default=env_str("SPLITSERVE_ADVERTISE_ADDRESS"),
                   help="host:port prefill pushes KV to (default: --host and the bound port)")
    p.add_argument("--reservation-timeout-s", type=float,
                   default=env_float("SPLITSERVE_RESERVATION_TIMEOUT_S", 30.0),
                   help="free a reservation whose KV / Decode call has not come by then")
    p.add_argument("--transfer-timeout-s", type=float,
                   default=env_float("SPLITSERVE_TRANSFER_TIMEOUT_S", 30.0),
                   help="how long a Decode call waits for its KV")
    return p.parse_args(argv)


async def amain(args) -> int:
    from common import runtime
    from decode_svc.kv_sink import EngineKVSink
    from decode_svc.servicer import SERVICE_NAME, DecodeServicer
    from engine.async_engine import AsyncEngine
    from kvtransfer import KVLayout, KVReceiver
    from kvtransfer.grpc_backend import KVTransferServicer
    from protos import decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc

    # NOTE: prefix caching is off on decode: its blocks are written by transfers, not computed
    cfg = engine_config_from_args(args, prefix_caching=False, role="decode")
    runtime.setup_tracing("splitserve-decode")
    engine = AsyncEngine(cfg)
    holder = {}

    def register(server):
        info = engine.info()
        layout = KVLayout(num_layers=info["num_layers"], num_kv_heads=info["num_kv_heads"],
                          head_dim=info["head_dim"], dtype=info["kv_dtype"],
                          block_size=info["block_size"])
        owner: dict[str, str] = {}  # request id -> transfer id (see EngineKVSink)
        rx = KVReceiver(EngineKVSink(engine, layout.block_size, owner), layout,
                        default_timeout_s=args.reservation_timeout_s)
        svc = DecodeServicer(engine, rx, runtime.get_metrics("decode"),
                             reservation_timeout_s=args.reservation_timeout_s,
                             transfer_timeout_s=args.transfer_timeout_s, owner=owner)
        holder.update(svc=svc, rx=rx)
        decode_pb2_grpc.add_DecodeServicer_to_server(svc, server)
        kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(rx), server)
        return [SERVICE_NAME, kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name]

    def started(port: int):
        host = args.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            import socket

            host = socket.gethostname()  # a wildcard bind is not an address peers can dial
        holder["svc"].address = args.advertise_address or f"{host}:{port}"

    return await runtime.serve("decode", args, engine, register,
                               on_stop=lambda: holder["rx"].close(), started=started)


def main(argv=None) -> int:
    return service_main("decode", parse_args, amain, argv)


if __name__ == "__main__":
    sys.exit(main())
