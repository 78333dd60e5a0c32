"""Where a serving run's TTFT exceeds the planner's simulation, request by request: the same
inputs as bench.plan_validate (its flags, passed through), then for each open-loop point and
for the steady part of the --loaded closed loop:

  excess    measured TTFT - (request overhead + stretch x prefill_ms(prompt)): what the
            request paid beyond its own prompt on a shared device, measured and simulated
  overlap   how many other requests were between their send and their first token at some
            time during this one's (prompts competing for the same path, from the rows alone)
  rows      decode rows in flight at its send (from the measured first-token and end times)
  together  pairs sent < 40 ms apart whose first tokens came < 2 ms apart: one prefill step,
            or one hold released for both; the earlier one then waited for the later one

plus a bootstrap interval of the measured P50 TTFT, to tell a miss from the run's own noise.
Reads stored results only (no server, no device).

    python -m lab.plan_ttft_overlap RATE.json ... --calibration COSTS.json --shape S \\
        --idle C1.json --loaded CN.json --prefill 1 --decode 1 --devices 1 \\
        --contended CONTENDED.json --fit-ttft-rows
"""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from bench.plan_validate import build, parser
from planner.fit import closed_run
from planner.replay import bench_points
from planner.simulate import simulate

TOGETHER_MS, PAIR_MS = 2.0, 40.0


def features(rows: list[dict]) -> dict:
    """Per-request arrays from a bench.serve run's rows (ok rows only), in send order."""
    rows = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["send_s"])
    send = np.array([r["send_s"] * 1e3 for r in rows])
    ttft = np.array([r["ttft_ms"] for r in rows])
    first, end = send + ttft, send + np.array([r["e2e_ms"] for r in rows])
    overlap = np.array([np.sum((send < first[i]) & (first > send[i])) - 1 for i in range(len(rows))])
    dec = np.array([np.sum((first < t) & (end > t)) for t in send])
    return {"idx": np.array([r.get("idx", i) for i, r in enumerate(rows)]), "send": send,
            "ttft": ttft, "first": first, "overlap": overlap, "rows": dec,
            "n": np.array([r["prompt_tokens"] for r in rows])}


def alone_ms(cal, n: np.ndarray) -> np.ndarray:
    """TTFT with nothing ahead on the path, the device shared with a busy decode."""
    return np.array([cal.ttft_overhead_ms + cal.contention * cal.prefill_ms(k) for k in n])


def report(name: str, f: dict, sim_ttft: np.ndarray, cal, rng) -> None:
    m, s = f["ttft"], sim_ttft
    base = alone_ms(cal, f["n"])
    boot = [np.percentile(rng.choice(m, len(m)), 50) for _ in range(2000)]
    print(f"{name}: n {len(m)}, P50 TTFT measured {np.median(m):.1f} (90% bootstrap "
          f"{np.percentile(boot, 5):.1f}-{np.percentile(boot, 95):.1f}) vs simulated {np.median(s):.1f}; "
          f"decode rows at send p50 {np.median(f['rows']):.0f}; overlap mean {f['overlap'].mean():.2f}")
    print("  overlap  n    excess measured  simulated   (median ms)")
    for o in range(4):
        sel = f["overlap"] == o if o < 3 else f["overlap"] >= 3
        if sel.any():
            print(f"  {o}{'+' if o == 3 else ' '}      {sel.sum():3d}  {np.median(m[sel] - base[sel]):8.1f}  "
                  f"{np.median(s[sel] - base[sel]):9.1f}")
    q = np.percentile(f["rows"], [0, 33, 67, 100])
    print("  rows at send   n    excess measured  simulated")
    for lo, hi in zip(q[:-1], q[1:]):
        sel = (f["rows"] >= lo) & (f["rows"] <= hi)
        print(f"  {lo:4.0f}-{hi:<4.0f}     {sel.sum():3d}  {np.median(m[sel] - base[sel]):8.1f}  "
              f"{np.median(s[sel] - base[sel]):9.1f}")
    send, first, n = f["send"], f["first"], f["n"]
    pairs = [(i, j) for i in range(len(send)) for j in range(i + 1, min(i + 4, len(send)))
             if send[j] - send[i] < PAIR_MS and abs(first[j] - first[i]) < TOGETHER_MS]
    sim_first = f["send"] + s
    sim_pairs = sum(1 for i in range(len(send)) for j in range(i + 1, min(i + 4, len(send)))
                    if send[j] - send[i] < PAIR_MS and abs(sim_first[j] - sim_first[i]) < TOGETHER_MS)
    print(f"  first tokens together (< {TOGETHER_MS:g} ms, sent < {PAIR_MS:g} ms apart): measured "
          f"{len(pairs)}, simulated {sim_pairs}")
    for i, j in pairs:
        both = cal.ttft_overhead_ms + cal.contention * cal.prefill_ms(n[i] + n[j])
        print(f"    sent {send[j] - send[i]:4.1f} ms apart, {n[i]:4d} + {n[j]:4d} tokens: earlier "
              f"{m[i]:5.1f} ms (alone {base[i]:5.1f}), later {m[j]:5.1f} (alone {base[j]:5.1f}, "
              f"one step with the earlier {both:5.1f})")


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    cal, cluster, _ = build(a)
    rng = np.random.default_rng(0)
    for path in a.serve:
        for p in bench_points(json.loads(open(path).read())):
            sim = {r.idx: r.ttft_ms for r in simulate(p["requests"], cal, cluster)}
            f = features(p["rows"])
            report(f"open loop {p['rate']:g} req/s", f, np.array([sim[i] for i in f["idx"]]), cal, rng)
    if a.loaded:
        run, reqs = closed_run(json.loads(open(a.loaded).read()), False)
        c = int(run["concurrency"])
        out = simulate([dataclasses.replace(r) for r in reqs], cal, cluster, concurrency=c)
        sim = {r.idx: r.ttft_ms for r in out}
        # steady part: past the start-up burst (every client at once) and its echo
        steady = sorted(run["requests"], key=lambda r: r["send_s"])[c + 8:]
        f = features(steady)
        report(f"closed loop c={c} (steady: requests {c + 8}+)", f,
               np.array([sim[i] for i in f["idx"]]), cal, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
