"""The planner's simulator against the serving benchmark: replay the exact trace a bench.serve
run sent (its config and request counts; bench/serve_trace.py) through planner/simulate.py with
a calibration, and print predicted vs measured P50 TTFT, P50 TPOT and goodput per load point.

    python -m bench.plan_validate bench/results/serve-*.json \\
        --calibration bench/results/engine_costs-*.json --shape smollm2-135m \\
        [--idle serve-c1.json --loaded serve-c8.json] [--prefill 0 --decode 1] [--kv-gbps G ...]

Calibration: engine step costs (engine_costs or engine_gpu rows of --shape) plus the serving
path's own costs, either given (--overhead-ms: per request before the engine, HTTP + gateway +
RPC; --step-overhead-ms: per decode step; --row-overhead-ms: per decode row a step, streaming
each token out through the service, gateway and client, which share the engine's cores on CPU)
or fitted from closed-loop bench.serve runs taken apart from the runs being checked: --idle at
concurrency 1 (each request alone: TTFT = overhead + prefill, TPOT = one step at batch 1) and
--loaded at concurrency N > 1 (the row overhead that makes the simulated closed loop's P50 TPOT
the measured one; with --fit-ttft-rows also the request overhead per decode row in flight, the
RPC hops waiting on event loops that stream those rows: planner/fit.py).
Decode steps follow the engine's measured batches (--decode-curve measured: the fitted line plus
its residual at each measured batch; `linear`: the line alone).
Shape: --prefill 0 is `up --topology colocated` (CPU's default), --prefill P --decode D a
split xPyD with the KV handoff at --kv-gbps. JSON to bench/results/plan_validate-<stamp>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from bench.common import print_table, write_result
from planner.calibration import calibrate, points_from_bench
from planner.fit import contention_from, fit_contention, fit_idle, fit_rows, fit_ttft_rows
from planner.replay import bench_points, summarize
from planner.simulate import Cluster, simulate

METRICS = (("ttft_ms_p50", "P50 TTFT ms"), ("tpot_ms_p50", "P50 TPOT ms"), ("goodput_rps", "goodput r/s"))


def is_cpu(path: str) -> bool:
    return json.loads(open(path).read()).get("config", {}).get("device", "cuda") == "cpu"


def padded_auto(path: str) -> bool:
    """Whether decode rows pay for the step's longest context in the engine the calibration
    measured: on CPU with the torch attention (contexts gathered into a copy padded to the
    longest), not with the C kernel (each row reads its own context: engine_costs records
    cpu_decode_attention 'native'). A CPU result that does not say is taken as padded."""
    cfg = json.loads(open(path).read()).get("config", {})
    return cfg.get("device", "cuda") == "cpu" and cfg.get("cpu_decode_attention") != "native"


def build(a):
    """(calibration with the serving overheads, cluster, (request, step, row overhead ms))."""
    if a.fit_contention and not (a.loaded and a.devices):
        raise ValueError("--fit-contention needs --loaded and --devices")
    if a.fit_ttft_rows and (a.fit_contention or not a.loaded):
        raise ValueError("--fit-ttft-rows needs --loaded and no --fit-contention (both fit its TTFT)")
    pre, dec = points_from_bench(a.calibration, a.shape)
    padded = a.padded_attention == "on" or (a.padded_attention == "auto" and padded_auto(a.calibration))
    cont = a.contention if a.contention is not None else \
        contention_from(a.calibration, a.contended, a.shape) if a.contended else 1.0
    cal = dataclasses.replace(calibrate(pre, dec, a.kv_bytes_per_token, a.kv_gbps, a.calibration,
                                        curve=a.decode_curve == "measured"),
                              contention=cont, padded_attention=padded,
                              contention_decode=not a.fit_contention)
    fit = fit_idle(json.loads(open(a.idle).read()), cal) if a.idle else (0.0, 0.0)
    over = a.overhead_ms if a.overhead_ms is not None else fit[0]
    step_over = a.step_overhead_ms if a.step_overhead_ms is not None else fit[1]
    d0, d1, d2 = cal.decode
    cal = dataclasses.replace(cal, decode=(d0 + step_over, d1, d2), ttft_overhead_ms=over,
                              ttft_row_ms=a.ttft_row_ms or 0.0)
    cluster = Cluster(a.prefill, a.decode, a.max_batched_tokens, a.max_seqs,
                      handoff_fixed_ms=a.handoff_fixed_ms, admission=a.admission, devices=a.devices)
    loaded = json.loads(open(a.loaded).read()) if a.loaded else None
    high = json.loads(open(a.loaded_high).read()) if a.loaded_high else None
    row_over = 0.0
    for _ in range(3 if a.fit_contention or a.fit_ttft_rows or high else 1):  # the fits interact: alternate them
        base = dataclasses.replace(cal, decode=(d0 + step_over, d1 + row_over, d2))
        if high:
            cal = dataclasses.replace(cal, row_growth=fit_rows(high, base, cluster, growth=True))
            base = dataclasses.replace(base, row_growth=cal.row_growth)
        if a.fit_contention:
            cal = dataclasses.replace(cal, contention=fit_contention(loaded, base, cluster))
            base = dataclasses.replace(base, contention=cal.contention)
        if a.fit_ttft_rows:
            cal = dataclasses.replace(cal, ttft_row_ms=fit_ttft_rows(loaded, base, cluster))
            base = dataclasses.replace(base, ttft_row_ms=cal.ttft_row_ms)
        base = dataclasses.replace(base, decode=(d0 + step_over, d1, d2))
        row_over = a.row_overhead_ms if a.row_overhead_ms is not None else \
            fit_rows(loaded, base, cluster) if loaded else 0.0
    cal = dataclasses.replace(cal, decode=(d0 + step_over, d1 + row_over, d2))
    return cal, cluster, (over, step_over, row_over)


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("serve", nargs="+", help="bench.serve result JSON(s) with open-loop points")
    ap.add_argument("--calibration", required=True, help="engine_costs or engine_gpu result JSON")
    ap.add_argument("--shape", default="smollm2-135m", help="the calibration rows' model shape")
    ap.add_argument("--idle", default=None, help="closed-loop concurrency-1 bench.serve result: fits "
                    "the serving overheads")
    ap.add_argument("--loaded", default=None, help="closed-loop concurrency-N bench.serve result: "
                    "fits the per-row overhead")
    ap.add_argument("--overhead-ms", type=float, default=None)
    ap.add_argument("--step-overhead-ms", type=float, default=None)
    ap.add_argument("--row-overhead-ms", type=float, default=None)
    ap.add_argument("--prefill", type=int, default=0, help="prefill replicas (0: colocated)")
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--kv-gbps", type=float, default=0.0)
    ap.add_argument("--kv-bytes-per-token", type=int, default=0)
    ap.add_argument("--handoff-fixed-ms", type=float, default=0.0)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--admission", action="store_true", help="reject at predicted TTFT > SLO")
    ap.add_argument("--devices", type=int, default=None, help="replicas share this many devices "
                    "(1: prefill and decode time-share one GPU / one CPU's cores); default one each")
    ap.add_argument("--contention", type=float, default=None, help="step stretch while two "
                    "replicas of a device are mid-step (default 1, or from --contended)")
    ap.add_argument("--contended", default=None, help="engine_costs result taken with --contend: "
                    "its rows over --calibration's give the stretch")
    ap.add_argument("--loaded-high", default=None, help="closed-loop bench.serve result at a larger "
                    "concurrency than --loaded: fits the per-row cost's growth with the batch")
    ap.add_argument("--fit-contention", action="store_true", help="fit the stretch of prefill "
                    "steps to --loaded's P50 TTFT instead; decode's share of the sharing stays in "
                    "the per-row overhead fitted to its P50 TPOT (the CPU case: the serving "
                    "processes that stream decode's tokens share the prefill engine's cores)")
    ap.add_argument("--fit-ttft-rows", action="store_true", help="fit the request overhead per "
                    "decode row in flight to --loaded's P50 TTFT (the request's RPC hops wait on "
                    "event loops streaming those rows' tokens); the stretch stays --contention / "
                    "--contended")
    ap.add_argument("--ttft-row-ms", type=float, default=None, help="request overhead per decode "
                    "row in flight, given instead of fitted")
    ap.add_argument("--decode-curve", choices=("measured", "linear"), default="measured",
                    help="decode step vs batch: through the engine's measured batches (the line "
                    "plus its residual at each, interpolated) or the fitted line alone")
    ap.add_argument("--padded-attention", choices=("auto", "on", "off"), default="auto",
                    help="decode rows pay for the step's longest context (auto: on for CPU "
                    "results unless they record the C kernel's attention, cpu_decode_attention native)")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--no-write", action="store_true")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        cal, cluster, fits = build(a)
        over, step_over, row_over = fits
        points = []
        for path in a.serve:
            doc = json.loads(open(path).read())
            cfg = doc["config"]
            for p in bench_points(doc):
                sim = summarize(simulate(p["requests"], cal, cluster, cfg.get("ttft_ms")),
                                cfg.get("ttft_ms"), cfg.get("tpot_ms"))
                m = p["measured"]
                points.append({"file": path, "commit": doc.get("commit"), "date": doc.get("date"),
                               "rate": p["rate"], "requests": m["requests"],
                               "slo": [cfg.get("ttft_ms"), cfg.get("tpot_ms")],
                               "predicted": sim, "measured": {k: m.get(k) for k in sim},
                               "error": {k: err(sim[k], m[k]) for k, _ in METRICS}})
    except (ValueError, OSError, KeyError) as e:
        print(f"plan_validate: {e}", file=sys.stderr)
        return 2
    p0, p1, p2 = cal.prefill
    d0, d1, d2 = cal.decode
    print(f"calibration {a.shape}: prefill_ms(n) = {p0:.3g} + {p1:.3g} n + {p2:.3g} n^2; "
          f"step_ms(B, ctx) = {d0:.3g} + {d1:.3g} B + {d2:.3g} B {'max ' if cal.padded_attention else ''}ctx "
          f"+ {cal.row_growth:.3g} B^2 (overheads incl.: step {step_over:.1f} ms, row {row_over:.2f} ms); request overhead "
          f"{over:.1f} ms + {cal.ttft_row_ms:.3g} ms a decode row in flight; {cluster.shape}, "
          f"{cluster.devices or 'a device each'} device(s), contention x{cal.contention:.2f}; "
          f"bend {' '.join(f'{b:g}:{y:+.2f}' for b, y in cal.bend) or 'none'}")
    rows = []
    for p in points:
        row = {"rate": f"{p['rate']:g}", "n": p["requests"]}
        for k, name in METRICS:
            e = p["error"][k]
            row[name] = f"{p['predicted'][k]:.3g} vs {p['measured'][k]:.3g}"
            row[f"{name.split()[0]} {name.split()[1]} err"] = \
                f"{e:+.0%}{'' if abs(e) <= a.tolerance else ' MISS'}"
        rows.append(row)
    print("predicted vs measured:")
    print_table(rows, list(rows[0]))
    if not a.no_write:
        print("wrote", write_result("plan_validate", {**vars(a), "cluster": dataclasses.asdict(cluster)},
                                    {"calibration": {"prefill": cal.prefill, "decode": cal.decode,
                                                     "overhead_ms": over, "step_overhead_ms": step_over,
                                                     "row_overhead_ms": row_over,
                                                     "contention": cal.contention,
                                                     "contention_decode": cal.contention_decode,
                                                     "row_growth": cal.row_growth,
                                                     "ttft_row_ms": cal.ttft_row_ms,
                                                     "bend": cal.bend,
                                                     "padded_attention": cal.padded_attention},
                                     "points": points}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
