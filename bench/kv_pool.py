"""KV handoff through the pool backends (vmm on a GPU, shm on CPU): what decode pays to take a
prompt's KV from prefill's mapped pool into its own reserved blocks.

    python -m bench.kv_pool --device cuda:0 [--tokens 128 512 2048 8192]   # vmm
    python -m bench.kv_pool --device cpu --layers 30 --kv-heads 3 --head-dim 64   # shm, SmolLM2

An owner process (prefill's role) allocates a shareable pool of the given KV shape (default
the Llama-3.1-8B cache: 32 layers x 8 KV heads x head_dim 128, bf16, block 16) and serves it;
this process maps it (`attach`, timed once) and copies each prompt's blocks into a local pool
with kvtransfer.backends.pool.copy_blocks, median of --repeats: once with the blocks in one
stretch (a fresh prompt) and once scattered (a fragmented pool, the gather path).
Prints a table, writes JSON to bench/results/.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time

import torch

from bench.common import print_table, write_result
from bench.timing import host_time_s


def _owner(q, nbytes: int, info: dict, device: str) -> None:
    from engine.kv_memory import allocate_pool
    from kvtransfer.backends.pool_share import PoolServer

    pool = allocate_pool(nbytes, device, shareable=True)
    pool.tensor.fill_(7)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    server = PoolServer(pool, info)
    q.put(server.address)
    time.sleep(3600)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_pool", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--elem-bytes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)

    from kvtransfer.backends.pool import copy_blocks
    from kvtransfer.endpoint import pool_backend_for
    from kvtransfer.backends.pool_share import attach

    block_bytes = a.block_size * a.kv_heads * a.head_dim * a.elem_bytes
    n_blocks = -(-max(a.tokens) // a.block_size) * 2
    info = {"num_layers": a.layers, "num_blocks": n_blocks, "block_bytes": block_bytes}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    owner = ctx.Process(target=_owner, args=(q, a.layers * 2 * n_blocks * block_bytes, info, a.device),
                        daemon=True)
    owner.start()
    rows, out = [], []
    try:
        address = q.get(timeout=300)
        t0 = time.perf_counter()
        peer = attach(address, a.device)
        attach_ms = (time.perf_counter() - t0) * 1e3
        dst = torch.zeros(a.layers * 2, n_blocks, block_bytes, dtype=torch.uint8, device=a.device)
        stream = torch.cuda.Stream(a.device) if a.device.startswith("cuda") else None
        rng = random.Random(0)
        for tok in a.tokens:
            n = -(-tok // a.block_size)
            nbytes = n * a.layers * 2 * block_bytes
            one = list(range(n))
            scattered = rng.sample(range(n_blocks), n), rng.sample(range(n_blocks), n)
            t_run = host_time_s(lambda: copy_blocks(peer.blocks, one, dst, one, stream), a.repeats)
            t_gat = host_time_s(lambda: copy_blocks(peer.blocks, scattered[0], dst, scattered[1], stream),
                                a.repeats)
            ok = bool((dst[:, :n] == 7).all())
            rows.append({"tokens": tok, "MiB": f"{nbytes / 2**20:.1f}", "ms (one stretch)": f"{t_run * 1e3:.3f}",
                         "GB/s": f"{nbytes / t_run / 1e9:.1f}", "ms (scattered)": f"{t_gat * 1e3:.3f}",
                         "GB/s ": f"{nbytes / t_gat / 1e9:.1f}", "exact": "yes" if ok else "NO"})
            out.append({"tokens": tok, "bytes": nbytes, "copy_ms_contiguous": t_run * 1e3,
                        "copy_ms_scattered": t_gat * 1e3, "byte_exact": ok})
        peer.close()
    finally:
        owner.kill()
    backend = pool_backend_for(a.device)
    print(f"{backend}: pool mapped in {attach_ms:.1f} ms ({peer.pool.kind})")
    print_table(rows, ["tokens", "MiB", "ms (one stretch)", "GB/s", "ms (scattered)", "GB/s ", "exact"])
    path = write_result("kv_pool", {"backend": backend, **vars(a)}, {"attach_ms": attach_ms, "rows": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
