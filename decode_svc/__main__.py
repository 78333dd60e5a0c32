"""`python -m decode_svc --model default --port 50071 --device cpu ...`"""
from __future__ import annotations

import argparse
import sys

from common.envs import env_float, env_int, env_str
from common.grpc_util import service_main
from common.service_args import (add_engine_args, add_kv_transfer_args, add_server_args,
                                 engine_config_from_args, kv_backend_from_args, pair_host)

# GPU: a step is one weight read, so spacing steps costs decode little and gives prefill the
# GPU; CPU: a step is compute on the cores prefill shares, and spacing steps slowed decode
# without speeding prefill up. Measured by `python -m bench.pd_system` (the 64-client case)
# with SPLITSERVE_PREFILL_YIELD_RATIO set to each value.
GPU_YIELD_RATIO = 24.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m decode_svc", description=__doc__)
    add_server_args(p, default_port=50071)
    add_engine_args(p)
    add_kv_transfer_args(p)
    p.add_argument("--kv-store-port", type=int, default=env_int("SPLITSERVE_KV_STORE_PORT", 0),
                   help="dist: port of the TCPStore prefill/decode pairs rendezvous on (0: a free one)")
    p.add_argument("--advertise-address", default=env_str("SPLITSERVE_ADVERTISE_ADDRESS"),
                   help="host:port prefill pushes KV to (default: --host and the bound port)")
    p.add_argument("--reservation-timeout-s", type=float,
                   default=env_float("SPLITSERVE_RESERVATION_TIMEOUT_S", 30.0),
                   help="free a reservation whose KV / Decode call has not come by then")
    p.add_argument("--reserve-ttl-s", type=float, default=env_float("SPLITSERVE_RESERVE_TTL_S", 60.0),
                   help="longest a reservation may hold KV blocks, whatever Reserve.timeout_ms asks")
    p.add_argument("--transfer-timeout-s", type=float,
                   default=env_float("SPLITSERVE_TRANSFER_TIMEOUT_S", 30.0),
                   help="how long a Decode call waits for its KV")
    p.add_argument("--prefill-yield-ratio", type=float,
                   default=env_float("SPLITSERVE_PREFILL_YIELD_RATIO", None),
                   help="while a prefill on this device has prompts for us in flight, start "
                        "steps at most every this many step times (0: never yield; default 24 on "
                        "a GPU, 0 on CPU, where a step is not one weight read but compute)")
    p.add_argument("--prefill-yield-max-ms", type=float,
                   default=env_float("SPLITSERVE_PREFILL_YIELD_MAX_MS", 150.0),
                   help="the longest gap between steps while yielding (also capped at half the "
                        "tightest TPOT budget of the running requests)")
    a = p.parse_args(argv)
    for k in ("prefill_yield_ratio", "prefill_yield_max_ms"):
        v = getattr(a, k)
        if v is not None and not (v >= 0 and v < float("inf")):
            p.error(f"--{k.replace('_', '-')} must be a finite number >= 0, got {v}")
    if a.reserve_ttl_s <= 0:
        p.error(f"--reserve-ttl-s must be > 0, got {a.reserve_ttl_s}")
    return a


async def amain(args) -> int:
    from common import runtime, telemetry
    from common.metrics import get_metrics
    from decode_svc.kv_sink import EngineKVSink
    from decode_svc.pacing import StepPacer
    from decode_svc.servicer import SERVICE_NAME, DecodeServicer
    from engine.async_engine import AsyncEngine
    from kvtransfer import KVLayout, KVReceiver
    from kvtransfer.backends.pool_service import PoolKVTransferService
    from kvtransfer.endpoint import (BACKENDS, backend_unavailable, device_id, local_endpoint,
                                     pair_transport, pool_backend_for)
    from kvtransfer.guard import GuardedSink, InflightGuard
    from protos import decode_pb2_grpc, kvtransfer_pb2, kvtransfer_pb2_grpc

    backend = kv_backend_from_args(args, BACKENDS, backend_unavailable)
    # prefix caching (unless --no-prefix-caching): a Reserve's prompt blocks already held here
    # are not transferred again (engine/kv_cache.py: reserve)
    cfg = engine_config_from_args(args, role="decode")
    telemetry.setup_tracing("splitserve-decode")
    engine = AsyncEngine(cfg)
    holder = {}
    host = pair_host(args.advertise_address.rpartition(":")[0] if args.advertise_address else args.host)

    def register(server):
        info = engine.info()
        layout = KVLayout(num_layers=info["num_layers"], num_kv_heads=info["num_kv_heads"],
                          head_dim=info["head_dim"], dtype=info["kv_dtype"],
                          block_size=info["block_size"])
        owner: dict[str, str] = {}  # request id -> transfer id (see EngineKVSink)
        sink = EngineKVSink(engine, layout.block_size, owner)
        guard = InflightGuard()  # nixl READs and pool copies into reserved blocks
        planes, accepted, pair = {}, ["grpc"], None
        t = args.kv_pair_timeout_s
        if backend == "dist":
            from kvtransfer.backends.dist import DistPlane, DistRendezvous

            rdv = holder["rdv"] = DistRendezvous(host, args.kv_store_port, t, bind_host=args.host)
            pair = local_endpoint(info["device"], rdv.address)
            planes[pair_transport(pair.device)] = lambda: DistPlane(rdv, pair, host, t,
                                                                    auth=args.internal_auth)
            accepted = ["dist", "grpc"]
        elif backend == "nixl":
            from kvtransfer.backends.nixl import NixlPlane, make_agent, register_kv_caches

            agent = make_agent(f"decode-{args.port}-{id(engine):x}")
            kv = engine.kv_cache_tensors()
            register_kv_caches(agent, kv)
            planes["nixl"] = lambda: NixlPlane(agent, kv, layout, engine.reserved_block_ids, guard, t)
            pair = local_endpoint(info["device"])
            accepted = ["nixl", "grpc"]
        takes_pool = _takes_pool(backend, info["device"])  # prefill on this host: copy from its pool
        if backend == "nixl" or takes_pool:
            sink = GuardedSink(sink, guard)
        rx = KVReceiver(sink, layout, default_timeout_s=args.reservation_timeout_s)
        importer = None
        if takes_pool:
            from kvtransfer.backends.pool import PoolImporter

            importer = PoolImporter(rx, engine.kv_block_view(), engine.reserved_block_ids, info["device"],
                                    guard=guard)
            accepted = [pool_backend_for(info["device"])] + accepted
            pair = pair or local_endpoint(info["device"])
            importer.device_id = device_id(pair)
            # a prefill mapped here shares our device: hold steps back while it works for us
            ratio = args.prefill_yield_ratio
            if ratio is None:
                ratio = GPU_YIELD_RATIO if info["device"].startswith("cuda") else 0.0
            engine.pacer = StepPacer(ratio, args.prefill_yield_max_ms / 1e3,
                                     lambda: rx.num_awaiting > 0 and importer.num_local_peers > 0)
        svc = DecodeServicer(engine, rx, get_metrics("decode"),
                             reservation_timeout_s=args.reservation_timeout_s,
                             transfer_timeout_s=args.transfer_timeout_s, owner=owner,
                             kv_backends=accepted, pair=pair, auth=args.internal_auth,
                             max_reservation_s=args.reserve_ttl_s)
        kvsvc = PoolKVTransferService(rx, planes, max_layer_bytes=layout.layer_nbytes(info["num_blocks"]),
                                      pool_importer=importer)
        svc.device_id = device_id(pair or local_endpoint(info["device"]))
        holder.update(svc=svc, rx=rx, kvsvc=kvsvc)
        decode_pb2_grpc.add_DecodeServicer_to_server(svc, server)
        kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(kvsvc, server)
        return [SERVICE_NAME, kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name]

    def started(port: int):
        holder["svc"].address = args.advertise_address or f"{pair_host(args.host)}:{port}"

    async def stop():
        await holder["rx"].close()
        await holder["kvsvc"].close()  # NOTE: waits for the pair groups before the store goes
        if "rdv" in holder:
            holder["rdv"].close()

    def busy() -> int:  # streams running + reservations whose KV / Decode call is still to come
        return len(holder["svc"]._running) + len(holder["rx"].pending())

    return await runtime.serve("decode", args, engine, register, on_stop=stop, started=started,
                               busy=busy)


def _takes_pool(backend: str, device: str) -> bool:
    """Whether this decode maps prefill pools: asked for, or auto where it can (vmm needs
    cuda-bindings)."""
    from kvtransfer.endpoint import POOL_BACKENDS, backend_unavailable, pool_backend_for

    want = pool_backend_for(device)
    if backend in POOL_BACKENDS:
        return backend == want
    return backend == "auto" and backend_unavailable(want) is None


def main(argv=None) -> int:
    return service_main("decode", parse_args, amain, argv)


if __name__ == "__main__":
    sys.exit(main())
