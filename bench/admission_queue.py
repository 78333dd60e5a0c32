"""The admission queue's cost to the gateway's event loop with many requests waiting.

    python -m bench.admission_queue [--waiters 0,100,500] [--seconds 3]

N requests wait in one AdmissionQueue (the load stays busy, so none is admitted); each decision
runs the gateway's delay model (Predictor.predict + decide, no routing). Meanwhile a ticker
sleeps 1 ms at a time and records how late it wakes: the delay every other coroutine of the
loop (streamed tokens, new requests) sees. Per N, with non-head waiters polling as often as the
head (`--idle-poll-s` = `--poll-s`, the old queue) and at the queue's default: decisions per
second, loop lag P50 / P99. JSON to bench/results/admission_queue-<stamp>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.common import print_table, write_result
from gateway.admission import AdmissionConfig, LoadView, Predictor, decide
from gateway.admission_queue import AdmissionQueue


async def one(waiters: int, seconds: float, poll_s: float, idle_poll_s: float) -> dict:
    q = AdmissionQueue()
    pred = Predictor(AdmissionConfig())
    busy = LoadView(queued_tokens=50_000, running=64, inflight_tokens=50_000, inflight_requests=64)
    calls = 0

    def fn(waited_ms: float):
        nonlocal calls
        calls += 1
        p = pred.predict(busy, busy, 200)
        return decide(p, 500.0, None, 0.0, 1e9)  # late: queued, re-decided on every poll

    tasks = [asyncio.create_task(q.run(fn, 0, poll_s=poll_s, idle_poll_s=idle_poll_s))
             for _ in range(waiters)]
    await asyncio.sleep(min(1.0, seconds / 3))  # every waiter in the queue, polls in phase
    calls, lags = 0, []
    t_end = time.monotonic() + seconds
    while (t := time.monotonic()) < t_end:
        await asyncio.sleep(0.001)
        lags.append((time.monotonic() - t - 0.001) * 1e3)
    rate = calls / seconds
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    lags.sort()
    return {"waiters": waiters, "idle_poll_s": idle_poll_s, "decisions_per_s": round(rate),
            "lag_p50_ms": round(statistics.median(lags), 3),
            "lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiters", default="0,100,500")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--poll-s", type=float, default=0.05)
    ap.add_argument("--idle-poll-s", type=float, default=0.5)
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    rows = []
    for n in [int(x) for x in a.waiters.split(",")]:
        for idle in (a.poll_s, a.idle_poll_s):
            rows.append(asyncio.run(one(n, a.seconds, a.poll_s, idle)))
            print(rows[-1], flush=True)
    print_table(rows, ["waiters", "idle_poll_s", "decisions_per_s", "lag_p50_ms", "lag_p99_ms"])
    print("results:", write_result("admission_queue", vars(a), {"rows": rows}))


if __name__ == "__main__":
    main()
