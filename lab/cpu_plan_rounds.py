"""Validate the CPU colocated planner round by round (the runs of lab/cpu_plan_rounds.sh).

For each round r, the planner is calibrated from that round's own calibration runs only: the
engine alone (engine_costs_r{r}, with `--costs round`; else one given engine_costs result),
the closed loops serve_r{r}_c1 (--idle) and serve_r{r}_c8 (--loaded); and checked on that
round's open loops (serve_r{r}_rate: 2.8 and 4.2 req/s). Then once more with a median
calibration (the engine's per-case median over rounds, and the median over rounds of the
overheads each round's closed loops fit against it), checked on every round's open loops.
Nothing is fitted to an open loop. Also prints each run's load from its per-request rows
(decode rows in flight = sum of decode intervals / wall), to compare the loops at equal load.

    python -m lab.cpu_plan_rounds --rounds 5,6,7,8 --costs round [--extra "FLAGS for plan_validate"]

Writes one plan_validate JSON per round and one for the median calibration, the median costs
(engine_costs_median-<stamp>.json, round mode) and a summary (cpu_plan_rounds-<stamp>.json)
to SPLITSERVE_BENCH_DIR; reads the runs from --runs-dir (bench/results).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from bench import plan_validate
from bench.common import print_table, write_result

COSTS = "bench/results/engine_costs-20261207T151215.json"
METRICS = ("ttft_ms_p50", "tpot_ms_p50", "goodput_rps")
FITS = ("overhead_ms", "step_overhead_ms", "row_overhead_ms", "ttft_row_ms")


RUNS_DIR = "bench/results"  # where the runs are read (--runs-dir); results go to SPLITSERVE_BENCH_DIR


def results_dir() -> str:
    return RUNS_DIR


def one(pattern: str) -> str:
    hits = sorted(glob.glob(os.path.join(results_dir(), pattern)))
    if len(hits) != 1:
        raise SystemExit(f"want exactly one {pattern}, found {hits}")
    return hits[0]


def rate_files(r: int) -> list[str]:
    return sorted(glob.glob(os.path.join(results_dir(), f"serve_r{r}_rate-*.json")))


def load_of(path: str) -> dict:
    """A bench.serve run's load from its per-request rows."""
    doc = json.load(open(path))
    run = doc["results"]["runs"][0]
    rows = [x for x in run["requests"] if x.get("status") == "ok"]
    t0 = min(x["send_s"] for x in rows)
    t1 = max(x["send_s"] + x["e2e_ms"] / 1e3 for x in rows)
    dec = sum((x["e2e_ms"] - x["ttft_ms"]) / 1e3 for x in rows)
    s = run["summary"]
    return {"file": os.path.basename(path), "kind": f"c={run['concurrency']}" if "concurrency" in run
            else f"{run['rate']:g} req/s", "date": doc["date"],
            "rows_in_flight": dec / (t1 - t0), "throughput_rps": s["throughput_rps"],
            "ttft_ms_p50": s["ttft_ms_p50"], "tpot_ms_p50": s["tpot_ms_p50"],
            "itl_ms_p50": s.get("itl_ms_p50"), "goodput_rps": s["goodput_rps"]}


def point(r: int, p: dict) -> dict:
    return {"round": r, "rate": p["rate"], **{f"pred_{k}": p["predicted"][k] for k in METRICS},
            **{f"meas_{k}": p["measured"][k] for k in METRICS},
            **{f"err_{k}": p["error"][k] for k in METRICS}}


def median_costs(paths: list[str]) -> str:
    """An engine_costs result whose rows are the per-case medians of these (cases all hold)."""
    docs = [json.load(open(p)) for p in paths]
    keys = [(r["shape"], r["case"]) for r in docs[0]["results"]["rows"]]
    rows = []
    for shape, case in keys:
        ms = [r["eager_ms"] for d in docs for r in d["results"]["rows"]
              if (r["shape"], r["case"]) == (shape, case) and r.get("eager_ms") is not None]
        if len(ms) == len(docs):
            rows.append({"shape": shape, "case": case, "eager_ms": statistics.median(ms)})
    conf = dict(docs[0]["config"]) | {"median_of": [os.path.basename(p) for p in paths]}
    path = write_result("engine_costs", conf, {"rows": rows})
    new = path.replace("engine_costs-", "engine_costs_median-")
    os.replace(path, new)
    return new


def validate(serve: list[str], costs: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.plan_validate", *serve, "--calibration", costs, *args]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    print(out, flush=True)
    path = re.search(r"^wrote (\S+)$", out, re.M).group(1)
    time.sleep(1.1)  # result names are stamped to the second
    return json.load(open(path)) | {"path": path}


def main(argv=None) -> int:
    global RUNS_DIR
    ap = argparse.ArgumentParser(prog="python -m lab.cpu_plan_rounds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", default="1,2,3,4")
    ap.add_argument("--extra", default="", help="more bench.plan_validate flags for every call")
    ap.add_argument("--name", default="cpu_plan_rounds")
    ap.add_argument("--costs", default=COSTS, help="engine_costs result for every round, or "
                    "'round': each round's own engine_costs_r{r} (lab/cpu_plan_rounds.sh COSTS=1)")
    ap.add_argument("--runs-dir", default=RUNS_DIR, help="where the rounds' bench.serve and engine_costs results are")
    a = ap.parse_args(argv)
    RUNS_DIR = a.runs_dir
    rounds = [int(x) for x in a.rounds.split(",")]
    extra = shlex.split(a.extra)

    loads = []
    for r in rounds:
        for p in [one(f"serve_r{r}_c1-*.json"), one(f"serve_r{r}_c8-*.json"), *rate_files(r)]:
            loads.append({"round": r, **load_of(p)})
    print("runs (rows in flight = sum of decode intervals / wall):")
    print_table(loads, ["round", "kind", "rows_in_flight", "throughput_rps", "ttft_ms_p50",
                        "tpot_ms_p50", "itl_ms_p50", "goodput_rps", "file"], ".3g")

    per_round, fits = [], []
    for r in rounds:
        costs = one(f"engine_costs_r{r}-*.json") if a.costs == "round" else a.costs
        v = validate(rate_files(r), costs, ["--idle", one(f"serve_r{r}_c1-*.json"),
                                            "--loaded", one(f"serve_r{r}_c8-*.json"), *extra])
        c = v["results"]["calibration"]
        fits.append({"round": r, "costs": os.path.basename(costs), **{k: c[k] for k in FITS}})
        for p in v["results"]["points"]:
            per_round.append(point(r, p) | {"plan_validate": v["path"]})
    print("fits per round (each against its own costs):")
    print_table(fits, list(fits[0]), ".3g")

    # the median calibration: the engine's per-case median over rounds (round mode), and the
    # median over rounds of the overheads each round's closed loops fit against those costs
    med_costs = median_costs([one(f"engine_costs_r{r}-*.json") for r in rounds]) \
        if a.costs == "round" else a.costs
    med_fits = []
    for r in rounds:
        ns = plan_validate.parser().parse_args(
            [rate_files(r)[0], "--calibration", med_costs, "--idle", one(f"serve_r{r}_c1-*.json"),
             "--loaded", one(f"serve_r{r}_c8-*.json"), *extra])
        cal, _, (over, step, row) = plan_validate.build(ns)
        med_fits.append({"round": r, "overhead_ms": over, "step_overhead_ms": step,
                         "row_overhead_ms": row, "ttft_row_ms": cal.ttft_row_ms})
    med = {k: statistics.median(f[k] for f in med_fits) for k in FITS}
    print(f"fits per round against {os.path.basename(med_costs)}, and their medians:")
    print_table(med_fits + [{"round": "median", **med}], list(med_fits[0]), ".3g")
    args = ["--overhead-ms", f"{med['overhead_ms']:.6g}", "--step-overhead-ms", f"{med['step_overhead_ms']:.6g}",
            "--row-overhead-ms", f"{med['row_overhead_ms']:.6g}", "--ttft-row-ms", f"{med['ttft_row_ms']:.6g}"]
    files = [f for r in rounds for f in rate_files(r)]
    v = validate(files, med_costs, args + [x for x in extra if x != "--fit-ttft-rows"])
    median_cal = [point(int(re.search(r"serve_r(\d+)_rate", f).group(1)), p)
                  for p, f in zip(v["results"]["points"], files)]

    def medians(rows: list[dict]) -> list[dict]:
        out = []
        for rate in sorted({x["rate"] for x in rows}):
            xs = [x for x in rows if x["rate"] == rate]
            m = {"rate": rate, "n": len(xs)}
            for k in METRICS:
                m[f"pred_{k}"] = statistics.median(x[f"pred_{k}"] for x in xs)
                m[f"meas_{k}"] = statistics.median(x[f"meas_{k}"] for x in xs)
                m[f"err_{k}"] = m[f"pred_{k}"] / m[f"meas_{k}"] - 1
                m[f"median_err_{k}"] = statistics.median(x[f"err_{k}"] for x in xs)
            out.append(m)
        return out

    cols = ["round", "rate", *[f"{p}_{k}" for k in METRICS for p in ("pred", "meas", "err")]]
    print("per round, calibrated from the same round's closed loops:")
    print_table(per_round, cols, ".3g")
    print("median calibration (each fitted overhead's median over rounds), every round's open loops:")
    print_table(median_cal, cols, ".3g")
    mcols = ["rate", "n", *[f"{p}_{k}" for k in METRICS for p in ("pred", "meas", "err", "median_err")]]
    summ = {"medians_per_round": medians(per_round), "medians_median_cal": medians(median_cal)}
    for name, rows in summ.items():
        print(f"medians over rounds ({name}: err = median pred / median measured - 1):")
        print_table(rows, mcols, ".3g")
    print("wrote", write_result(a.name, vars(a), {"loads": loads, "fits": fits, "median_fit": med,
                                                  "per_round": per_round, "median_cal": median_cal,
                                                  "median_fits": med_fits, "median_costs": med_costs,
                                                  "median_plan_validate": v["path"], **summ}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
