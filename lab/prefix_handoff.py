"""What decode's prefix cache saves on the KV handoff: one prefill + decode pair (SmolLM2 on
CPU by default) per backend, decode's prefix caching on and off; a warm request, then requests
sharing its long prefix with distinct tails, driven by the tests' client over loopback.

    python -m lab.prefix_handoff [--shared 480 --tail 8 --requests 8 --backends shm,grpc]

Prints per backend and setting: blocks held by decode, KV bytes sent, prefill's transfer time
and the Reserve -> Prefill time (medians over the shared-prefix requests)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from engine.sampling_params import SamplingParams
from tests import harness
from tests.services.client import Client

MODEL = ["--model", "default", "--dtype", "fp32", "--device", "cpu", "--max-model-len", "1024",
         "--num-blocks", "256", "--enforce-eager"]


async def measure(pre, dec, shared: list[int], tail: int, requests: int) -> dict:
    c = Client(pre.address, dec.address)
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        await c.generate("warm", shared + [5] * tail, p)
        rows = []
        for i in range(requests):
            t = time.perf_counter()
            ticket, resp, call = await c.start(f"r{i}", shared + [100 + i] * tail, p)
            ms = (time.perf_counter() - t) * 1e3
            async for _ in call:
                pass
            rows.append((ticket.num_cached_blocks, resp.kv_bytes, resp.timings.transfer_ms, ms))
    finally:
        await c.close()
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"held_blocks": med(0), "kv_bytes": med(1), "transfer_ms": med(2), "reserve_prefill_ms": med(3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", type=int, default=480)
    ap.add_argument("--tail", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--backends", default="shm,grpc")
    a = ap.parse_args()
    shared = list(range(1000, 1000 + a.shared))
    out = []
    for backend in a.backends.split(","):
        flag = [] if backend == "shm" else ["--kv-transfer-backend", backend]
        for caching in (True, False):
            dec_extra = [*MODEL, *flag, *([] if caching else ["--no-prefix-caching"])]
            with harness.service_pair([*MODEL, *flag], dec_extra) as (pre, dec):
                r = asyncio.run(measure(pre, dec, shared, a.tail, a.requests))
            out.append({"backend": backend, "decode_prefix_caching": caching, **r})
            print(f"{backend:5s} caching={'on ' if caching else 'off'} held={r['held_blocks']:4.0f} "
                  f"kv={r['kv_bytes'] / 2**20:7.2f} MiB transfer={r['transfer_ms']:7.2f} ms "
                  f"reserve+prefill={r['reserve_prefill_ms']:7.1f} ms", flush=True)
    d = os.environ.get("SPLITSERVE_BENCH_DIR", "lab/results")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"prefix_handoff-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(a), "rows": out}, f, indent=1)
    print(path)


if __name__ == "__main__":
    main()
