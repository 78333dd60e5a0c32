"""`splitserve plan`: how many prefill and decode replicas a load needs to meet its SLOs.

    splitserve plan --rate 20 --input-len 2048 --output-len 256 --ttft-ms 500 --tpot-ms 20 \\
                    --model-shape llama-3.1-8b [--calibration bench/results/engine_gpu-*.json]

Calibration: the newest bench/results/engine_gpu-*.json of this checkout (prefill and decode
step times of --model-shape on that GPU), or --prefill-points / --decode-points; KV handoff
time from the newest kv_transfer-*.json row of --kv-backend (none: not counted).
The queueing model (planner/model.py) gives a first answer; the discrete-event simulator
(planner/simulate.py) then replays a seeded trace of the load (bench/serve_trace.py's
generator, --sim-requests requests) through shapes around it (planner/search.py) and its
answer is the recommendation (--no-sim: the queueing model's alone).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, required=True, help="arrival rate, requests/s (Poisson)")
    p.add_argument("--input-len", type=float, default=512, help="mean prompt tokens")
    p.add_argument("--output-len", type=float, default=128, help="mean generated tokens")
    p.add_argument("--input-cv", type=float, default=0.0,
                   help="prompt length spread, std/mean of a lognormal (0: fixed)")
    p.add_argument("--output-cv", type=float, default=0.0, help="output length spread (std/mean)")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT SLO at --quantile")
    p.add_argument("--tpot-ms", type=float, required=True, help="TPOT SLO at --quantile")
    p.add_argument("--quantile", type=float, default=0.9, help="SLO percentile, e.g. 0.9 or 0.99")
    p.add_argument("--model-shape", default="llama-3.1-8b",
                   help="model shape: its rows in the calibration file and its KV bytes per token")
    p.add_argument("--calibration", default=None,
                   help="engine_gpu result JSON (default: the newest in bench/results)")
    p.add_argument("--prefill-points", default=None, metavar="TOKENS:MS,...",
                   help="prefill times instead of the file's, e.g. 128:6,512:14,2048:55")
    p.add_argument("--decode-points", default=None, metavar="BxCTX:MS,...",
                   help="decode step times instead of the file's, e.g. 1x1024:4.1,64x1024:7.4")
    p.add_argument("--kv-backend", default=None,
                   help="count the KV handoff at this backend's measured GB/s (newest kv_transfer result)")
    p.add_argument("--kv-gbps", type=float, default=None, help="KV handoff rate, GB/s (wins over --kv-backend)")
    p.add_argument("--ttft-overhead-ms", type=float, default=0.0,
                   help="per-request time on top of prefill + handoff: gateway and RPC hops "
                        "(pd_system on the H200: ~11 ms)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="serving cost a decode step on top of the engine's (bench.plan_validate fits it)")
    p.add_argument("--row-overhead-ms", type=float, default=0.0,
                   help="serving cost a decode row a step: streaming the token out (CPU: ~1-2 ms)")
    p.add_argument("--max-batch", type=int, default=256, help="most running requests per decode replica")
    p.add_argument("--topology", choices=("split", "colocated"), default="split",
                   help="simulate xPyD (split) or replicas that prefill in their decode batches")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="engine token budget a step")
    p.add_argument("--handoff-fixed-ms", type=float, default=0.0, help="per-request KV handoff cost "
                   "besides bytes / rate")
    p.add_argument("--devices", type=int, default=None,
                   help="the replicas share this many devices (default: a device per replica)")
    p.add_argument("--contention", type=float, default=1.0,
                   help="step stretch while two replicas of one device are mid-step (1: none, "
                   "2: strict time-slicing; k replicas: 1 + (x - 1)(k - 1)); lab.plan_gpu fits it")
    p.add_argument("--contention-prefill-only", action="store_true",
                   help="only prefill (and colocated) replicas' steps stretch")
    p.add_argument("--admission", action="store_true",
                   help="simulate the gateway rejecting requests predicted past the TTFT SLO")
    p.add_argument("--sim-requests", type=int, default=2000, help="simulated trace length")
    p.add_argument("--seed", type=int, default=0, help="simulated trace seed")
    p.add_argument("--no-sim", action="store_true", help="the queueing model only (no simulation)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _newest(pattern: str) -> Path | None:
    files = sorted(RESULTS.glob(pattern))
    return files[-1] if files else None


def _kv_gbps(backend: str) -> tuple[float, str]:
    f = _newest("kv_transfer-*.json")
    rows = [r for r in json.loads(f.read_text())["results"]["rows"] if r["backend"] == backend] if f else []
    if not rows:
        raise ValueError(f"--kv-backend {backend}: no kv_transfer result in {RESULTS} has a {backend} row "
                         "(run python -m bench.kv_transfer, or give --kv-gbps)")
    r = max(rows, key=lambda r: r["tokens"])
    return float(r["GB/s"]), f"{f.name} ({backend}, {r['tokens']} tokens)"


def calibration_from_args(a: argparse.Namespace):
    from planner.calibration import calibrate, kv_bytes_per_token, parse_points, points_from_bench

    pre = parse_points(a.prefill_points, False) if a.prefill_points else None
    dec = parse_points(a.decode_points, True) if a.decode_points else None
    source = "flags"
    if pre is None or dec is None:
        path = Path(a.calibration) if a.calibration else _newest("engine_gpu-*.json")
        if path is None:
            raise ValueError(f"no engine_gpu result in {RESULTS}: give --calibration or "
                             "--prefill-points and --decode-points")
        fpre, fdec = points_from_bench(path, a.model_shape)
        pre, dec = pre or fpre, dec or fdec
        source = f"{path.name} ({a.model_shape})"
    gbps, kv_src = 0.0, "not counted"
    if a.kv_gbps is not None:
        gbps, kv_src = a.kv_gbps, f"{a.kv_gbps:g} GB/s (flag)"
    elif a.kv_backend:
        gbps, kv_src = _kv_gbps(a.kv_backend)
    if a.step_overhead_ms < 0 or a.row_overhead_ms < 0:
        raise ValueError("--step-overhead-ms and --row-overhead-ms must be >= 0")
    cal = calibrate(pre, dec, kv_bytes_per_token(a.model_shape), gbps, source, a.ttft_overhead_ms)
    d0, d1, d2 = cal.decode
    return replace(cal, decode=(d0 + a.step_overhead_ms, d1 + a.row_overhead_ms, d2),
                   contention=a.contention, contention_decode=not a.contention_prefill_only), kv_src


def _fmt(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.1f}"


def render(plan, w, cal, kv_src: str) -> str:
    q = f"p{w.quantile * 100:g}"
    p0, p1, p2 = cal.prefill
    d0, d1, d2 = cal.decode
    out = [f"calibration: {cal.source}",
           f"  prefill_ms(n) = {p0:.3g} + {p1:.3g} n + {p2:.3g} n^2;  "
           f"step_ms(B, ctx) = {d0:.3g} + {d1:.3g} B + {d2:.3g} B ctx;  KV handoff: {kv_src}; "
           f"overhead {cal.ttft_overhead_ms:g} ms",
           f"load: {w.rate:g} req/s, prompts {w.input_len:g} tokens (cv {w.input_cv:g}), "
           f"outputs {w.output_len:g} (cv {w.output_cv:g}); SLO {q} TTFT {w.ttft_ms:g} ms, "
           f"TPOT {w.tpot_ms:g} ms", "",
           f"prefill   util   P(wait)  wait {q} ms  TTFT mean ms  TTFT {q} ms  meets"]
    for p in plan.prefill_table:
        ok = "yes" if p.stable and p.ttft_ms_q <= w.ttft_ms else "no"
        out.append(f"{p.replicas:>7}  {min(p.utilization, 9.99):5.2f}  {p.wait_prob:7.3f}  "
                   f"{_fmt(p.wait_ms_q):>11}  {_fmt(p.ttft_ms_mean):>12}  {_fmt(p.ttft_ms_q):>11}  {ok}")
    out += ["", f"decode   batch mean  batch {q}  TPOT mean ms  TPOT {q} ms  meets"]
    for d in plan.decode_table:
        ok = "yes" if d.stable and d.tpot_ms_q <= w.tpot_ms else "no"
        out.append(f"{d.replicas:>6}  {_fmt(d.batch_mean):>10}  {_fmt(d.batch_q):>9}  "
                   f"{_fmt(d.tpot_ms_mean):>12}  {_fmt(d.tpot_ms_q):>11}  {ok}")
    pp, dd = plan.prefill, plan.decode
    out += ["", f"queueing model: {plan.shape} ({pp.replicas + dd.replicas} GPUs): predicted {q} TTFT "
            f"{pp.ttft_ms_q:.1f} ms, {q} TPOT {dd.tpot_ms_q:.2f} ms, {dd.tokens_per_s:.0f} output tokens/s"]
    return "\n".join(out)


def simulated(a: argparse.Namespace, w, cal, first):
    """(best SimPoint, all simulated) around the queueing model's answer `first`."""
    from planner.replay import lognormal_spec, trace_requests
    from planner.search import search
    from planner.simulate import Cluster

    if a.sim_requests < 1:
        raise ValueError(f"--sim-requests must be >= 1, got {a.sim_requests}")
    reqs = trace_requests(a.sim_requests, w.rate, lognormal_spec(w.input_len, w.input_cv),
                          lognormal_spec(w.output_len, w.output_cv), a.seed)
    base = Cluster(0 if a.topology == "colocated" else 1, 1, a.max_batched_tokens, a.max_batch,
                   handoff_fixed_ms=a.handoff_fixed_ms, admission=a.admission, devices=a.devices)
    start = (first.prefill.replicas, first.decode.replicas)
    if a.topology == "colocated":
        start = (0, max(1, max(start) - 1))
    return search(reqs, cal, base, w.ttft_ms, w.tpot_ms, w.quantile, start)


def render_sim(best, seen, w, devices: int | None = None) -> str:
    q = f"p{w.quantile * 100:g}"
    out = ["", f"simulated ({best.figures['requests']} requests):",
           f"shape           TTFT p50 ms  TTFT {q} ms  TPOT p50 ms  TPOT {q} ms  goodput r/s  meets"]
    for s in seen:
        f = s.figures
        out.append(f"{s.shape:<14}  {_fmt(f['ttft_ms_p50']):>11}  {_fmt(f['ttft_ms_q']):>11}  "
                   f"{_fmt(f['tpot_ms_p50']):>11}  {_fmt(f['tpot_ms_q']):>11}  {f['goodput_rps']:11.2f}  "
                   f"{'yes' if s.meets else 'no'}")
    f = best.figures
    gpus = best.prefill + best.decode
    where = f"{gpus} replicas" if devices is None else f"{gpus} replicas on {devices} device(s)"
    out.append(f"recommended (simulated): {best.shape} ({where}): {q} TTFT {f['ttft_ms_q']:.1f} ms, "
               f"{q} TPOT {f['tpot_ms_q']:.2f} ms, goodput {f['goodput_rps']:.2f} req/s")
    return "\n".join(out)


def run(a: argparse.Namespace) -> int:
    from planner.model import Workload, plan

    try:
        w = Workload(a.rate, a.input_len, a.output_len, a.input_cv, a.output_cv, a.ttft_ms,
                     a.tpot_ms, a.quantile)
        cal, kv_src = calibration_from_args(a)
        if a.devices is not None and a.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {a.devices}")
        if a.devices is not None and a.no_sim:
            raise ValueError("--devices needs the simulation (the queueing model gives each replica a device)")
        result = plan(w, cal, max_batch=a.max_batch)
        sim = None if a.no_sim else simulated(a, w, cal, result)
    except (ValueError, OSError) as e:
        print(f"splitserve plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"shape": result.shape, "workload": asdict(w),
                          "calibration": {"source": cal.source, "prefill": cal.prefill, "decode": cal.decode,
                                          "kv_bytes_per_token": cal.kv_bytes_per_token, "kv_gbps": cal.kv_gbps,
                                          "contention": cal.contention,
                                          "contention_decode": cal.contention_decode},
                          "devices": a.devices,
                          "prefill": asdict(result.prefill), "decode": asdict(result.decode),
                          "prefill_table": [asdict(p) for p in result.prefill_table],
                          "decode_table": [asdict(d) for d in result.decode_table],
                          "simulated": None if sim is None else
                          {"shape": sim[0].shape, "best": asdict(sim[0]), "tried": [asdict(s) for s in sim[1]]}},
                         default=str))
    else:
        print(render(result, w, cal, kv_src) + ("" if sim is None else render_sim(*sim, w, a.devices)))
    return 0
