"""Cost of the internal plane's credentials: one prefill + decode pair with a shared secret and
one open (--insecure-internal), each driven by the tests' client over loopback.

    python -m lab.auth_overhead [--calls 2000] [--requests 20]

Prints per pair: Decode.Load round trip (median / p90, us) and a whole request (Reserve ->
Prefill -> Decode, 64 tokens; median ms)."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from common.auth import InternalAuth, write_secret_file
from engine.sampling_params import SamplingParams
from protos import common_pb2
from tests import harness
from tests.services.client import Client

SECRET = "bench-" + "k" * 40


async def measure(pre, dec, auth, calls: int, requests: int) -> dict:
    c = Client(pre.address, dec.address, auth)
    try:
        for _ in range(50):
            await c.decode.Load(common_pb2.LoadRequest())
        lat = []
        for _ in range(calls):
            t = time.perf_counter()
            await c.decode.Load(common_pb2.LoadRequest())
            lat.append((time.perf_counter() - t) * 1e6)
        p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        req = []
        for i in range(requests + 2):
            t = time.perf_counter()
            await c.generate(f"r{i}", list(range(3, 40)), p)
            req.append((time.perf_counter() - t) * 1e3)
        lat.sort()
        return {"load_us_p50": lat[len(lat) // 2], "load_us_p90": lat[int(len(lat) * 0.9)],
                "request_ms_p50": statistics.median(req[2:])}
    finally:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=20)
    a = ap.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "secret")
    write_secret_file(path, SECRET)
    for label, flags, auth in (("open", [], None),
                               ("secret", ["--internal-secret-file", path], InternalAuth(secret=SECRET))):
        with harness.service_pair(flags, flags) as (pre, dec):
            r = asyncio.run(measure(pre, dec, auth, a.calls, a.requests))
        print(label, {k: round(v, 1) for k, v in r.items()})


if __name__ == "__main__":
    main()
