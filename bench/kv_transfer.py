"""KV transfer bandwidth per backend, for one request's KV of a given shape (default: the
Llama-3.1-8B cache, 32 layers x 8 KV heads x head_dim 128, bf16, block 16).

    python -m bench.kv_transfer [--tokens 128 2048 8192] [--layers 32] [--repeats 5]
                                [--backends grpc dist nixl nccl peer]

A receiver runs in its own process (kvtransfer.loopback: the decode-side endpoints in front of
a paged cache, writes landing in reserved blocks as on decode); this process sends. One
transfer = open -> every layer -> commit -> ack; timed end to end, median of --repeats after a
warm-up transfer (which also sets up the pair). Rows:

    grpc   gRPC chunks over loopback (CPU tensors; what prefill does without a direct backend)
    dist   torch.distributed gloo between two CPU processes
    nixl   NIXL READs (UCX) between two CPU processes, host memory (needs a NIXL wheel,
           e.g. nixl-cu12; UCX_TLS picks UCX's transports, recorded in the JSON);
           --nixl-device cuda:0 adds rows with GPU memory, both processes on that GPU
    nccl   dist over NCCL, sender cuda:0 -> receiver cuda:1 (needs two GPUs)
    peer   tensor.to('cuda:1') from cuda:0 in one process: the copy-engine ceiling (two GPUs)

Prints a table, writes JSON to bench/results/ (bench.common.write_result).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch

from bench.common import print_table, write_result
from engine.kv_blocks import KVBlocks
from kvtransfer import KVLayout, send_blocks
from kvtransfer.loopback import ReceiverProc


def _layer(layout: KVLayout, n_blocks: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 255, (layout.layer_nbytes(n_blocks),), dtype=torch.uint8, generator=g)
    return t.view(layout.torch_dtype).reshape(layout.layer_shape(n_blocks)).to(device)


async def _bench_sender(name: str, sender, rp: ReceiverProc, layout: KVLayout, tokens: int,
                        repeats: int, device: str) -> dict:
    n_blocks = -(-tokens // layout.block_size)
    layer = _layer(layout, n_blocks, device)  # NOTE: every layer sends this one tensor (reads only)
    kv = KVBlocks(layout.block_size, tokens, layout.dtype, [layer] * layout.num_layers)
    times = []
    for i in range(repeats + 1):
        tid = f"{name}-{tokens}-{i}"
        rp.expect(tid, tid, list(range(n_blocks)), tokens)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = await send_blocks(sender, rp.address, tid, tid, kv, layout, 600, peer=rp.endpoint)
        dt = time.perf_counter() - t0
        rp.claim(tid)
        if i:  # the first one warms up (and pairs)
            times.append(dt)
    med = statistics.median(times)
    return {"backend": name, "tokens": tokens, "bytes": n, "ms": round(med * 1e3, 3),
            "GB/s": round(n / med / 1e9, 3), "min_ms": round(min(times) * 1e3, 3)}


async def _rows_on(name: str, layout: KVLayout, max_blocks: int, a, rx_device: str, tx_device: str,
                   make_sender, nixl: bool = False) -> list[dict]:
    """One backend's rows: a receiver process with its cache on rx_device, a sender from
    make_sender() sending from tx_device, every --tokens size."""
    rows = []
    rp = ReceiverProc.spawn(layout, num_blocks=max_blocks, device=rx_device, timeout_s=120, nixl=nixl)
    try:
        s = make_sender()
        for tokens in a.tokens:
            rows.append(await _bench_sender(name, s, rp, layout, tokens, a.repeats, tx_device))
            print(rows[-1], flush=True)
        await s.close()
    finally:
        rp.stop()
    return rows


def _peer_copy(layout: KVLayout, tokens: int, repeats: int) -> dict:
    n_blocks = -(-tokens // layout.block_size)
    src = [_layer(layout, n_blocks, "cuda:0") for _ in range(2)]
    nbytes = layout.layer_nbytes(n_blocks) * layout.num_layers
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        for li in range(layout.num_layers):
            src[li % 2].to("cuda:1", non_blocking=True)
        torch.cuda.synchronize("cuda:1")
        torch.cuda.synchronize("cuda:0")
        if i:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"backend": "peer", "tokens": tokens, "bytes": nbytes, "ms": round(med * 1e3, 3),
            "GB/s": round(nbytes / med / 1e9, 3), "min_ms": round(min(times) * 1e3, 3)}


async def run(a) -> list[dict]:
    from kvtransfer.backends.dist import DistKVSender
    from kvtransfer.backends.grpc import GrpcKVSender
    from kvtransfer.endpoint import local_endpoint

    layout = KVLayout(a.layers, a.kv_heads, a.head_dim, a.dtype, a.block_size)
    max_blocks = -(-max(a.tokens) // a.block_size)
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    rows = []
    want = set(a.backends)
    nixl_why = None
    if "nixl" in want:
        from kvtransfer.backends.nixl_probe import nixl_api

        try:
            nixl_api()
        except ImportError as e:
            nixl_why = str(e)
            print(f"skipped nixl: no NIXL wheel imports ({e})", flush=True)
    def nixl_sender(dev: str):
        from kvtransfer.backends.nixl_sender import NixlKVSender

        # NOTE: staging holds a whole layer of the largest request, with room for two
        return NixlKVSender(local_endpoint(dev), op_timeout_s=120, connect_timeout_s=30,
                            staging_bytes=2 * layout.layer_nbytes(max_blocks))

    cpu_nixl = "nixl" in want and nixl_why is None and "cpu" in a.nixl_device
    if want & {"grpc", "dist"} or cpu_nixl:
        rp = ReceiverProc.spawn(layout, num_blocks=max_blocks, timeout_s=120, nixl=cpu_nixl)
        try:
            senders = []
            if "grpc" in want:
                senders.append(("grpc", GrpcKVSender(chunk_bytes=a.chunk_bytes)))
            if "dist" in want:
                senders.append(("dist", DistKVSender(local_endpoint("cpu"), host="127.0.0.1",
                                                     op_timeout_s=120, connect_timeout_s=30)))
            if cpu_nixl:
                senders.append(("nixl", nixl_sender("cpu")))
            for name, s in senders:
                for tokens in a.tokens:
                    rows.append(await _bench_sender(name, s, rp, layout, tokens, a.repeats, "cpu"))
                    print(rows[-1], flush=True)
                await s.close()
        finally:
            rp.stop()
    for dev in a.nixl_device:  # GPU memory registered with NIXL, both processes on this GPU
        if "nixl" not in want or nixl_why is not None or not dev.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            print(f"skipped nixl on {dev}: no CUDA", flush=True)
            continue
        rows += await _rows_on(f"nixl-{dev}", layout, max_blocks, a, dev, dev,
                               lambda dev=dev: nixl_sender(dev), nixl=True)
    if "nccl" in want and two_gpus:
        rows += await _rows_on("nccl", layout, max_blocks, a, "cuda:1", "cuda:0", lambda: DistKVSender(
            local_endpoint("cuda:0"), host="127.0.0.1", op_timeout_s=120))
    if "peer" in want and two_gpus:
        for tokens in a.tokens:
            rows.append(_peer_copy(layout, tokens, a.repeats))
    skipped = sorted(want & {"nccl", "peer"}) if not two_gpus else []
    if skipped:
        print(f"skipped {', '.join(skipped)}: needs two CUDA GPUs", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nixl-device", nargs="+", default=["cpu"],
                    help="where nixl's KV lives: cpu (host memory) and/or cuda:N (GPU memory, both "
                         "processes on that GPU)")
    ap.add_argument("--chunk-bytes", type=int, default=2 << 20, help="grpc chunk size")
    ap.add_argument("--backends", nargs="+", default=["grpc", "dist", "nixl", "nccl", "peer"],
                    choices=["grpc", "dist", "nixl", "nccl", "peer"])
    a = ap.parse_args()
    rows = asyncio.run(run(a))
    print_table(rows, ["backend", "tokens", "bytes", "ms", "GB/s", "min_ms"])
    cfg = {k: v for k, v in vars(a).items()}
    cfg["UCX_TLS"] = os.environ.get("UCX_TLS", "(unset: UCX's choice)")
    cfg["loadavg_1m"] = round(os.getloadavg()[0], 2)  # NOTE: a shared host's load skews every row
    cfg["shape"] = (f"{a.layers} layers x 2 x {a.kv_heads} kv heads x {a.head_dim} x {a.dtype}, "
                    f"block {a.block_size}")
    print("wrote", write_result("kv_transfer", cfg, {"rows": rows}))


if __name__ == "__main__":
    main()
