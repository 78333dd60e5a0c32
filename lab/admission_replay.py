"""Replay a serving-bench run's admitted requests through the gateway's TTFT Calibrator, in
the order the gateway saw them (decided at send + gateway queue, observed at the first token),
and compare the calibrated TTFT error of variants on the requests sent after the first
quarter. Needs rows with `parts` (bench/serve_client.PARTS: the raw and idle predictions, the
bucket, the gateway queue). The `current` variant reproduces the logged predictions.

    python -m lab.admission_replay RUN.json [--rate R]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from gateway.calibration import Calibrator


def rows_of(path: str, rate: float | None) -> list[dict]:
    runs = json.load(open(path))["results"]["runs"]
    run = next(r for r in runs if rate is None or r.get("rate") == rate)
    return [x for x in run["requests"] if x["status"] == "ok" and "parts" in x]


def replay(rows: list[dict], cal: Calibrator) -> dict:
    ev = []
    for i, x in enumerate(rows):
        td = x["send_s"] + x["parts"].get("queue_ms", 0.0) / 1e3
        ev += [(td, 0, i), (td + x["gw_ttft_ms"] / 1e3, 1, i)]
    est = {}
    for _t, kind, i in sorted(ev):
        p = rows[i]["parts"]
        b, raw = int(p["predicted_ttft_bucket"]), p["predicted_raw_ttft_ms"]
        if kind == 0:
            est[i] = cal.correct(raw, b)
        else:
            cal.observe(raw, est[i], rows[i]["gw_ttft_ms"], b)
    t_end = max(x["send_s"] for x in rows)
    steady = [i for i, x in enumerate(rows) if x["send_s"] > t_end / 4]
    e = np.array([est[i] for i in steady])
    got = np.array([rows[i]["gw_ttft_ms"] for i in steady])
    logged = np.array([rows[i]["pred_ttft_ms"] for i in steady])
    return {"ape": float(np.median(abs(e - got) / got)), "logged_ape": float(np.median(abs(logged - got) / got)),
            "vs_logged": float(np.median(e / logged)), "n": len(steady)}


def oracle(rows: list[dict]) -> float:
    """The best constant correction c + k * raw in hindsight (a floor for online ones)."""
    t_end = max(x["send_s"] for x in rows)
    s = [x for x in rows if x["send_s"] > t_end / 4]
    got = np.array([x["gw_ttft_ms"] for x in s])
    raw = np.array([x["parts"]["predicted_raw_ttft_ms"] for x in s])
    return min(float(np.median(abs(c + k * raw - got) / got))
               for k in np.linspace(0.5, 3.0, 51) for c in np.linspace(-30, 40, 36))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.admission_replay")
    p.add_argument("run")
    p.add_argument("--rate", type=float)
    a = p.parse_args(argv)
    rows = rows_of(a.run, a.rate)
    variants = {"ewma (alpha 0.15)": lambda: Calibrator(additive=True),
                "ewma (alpha 0.05)": lambda: Calibrator(additive=True, alpha=0.05)}
    for w in (32, 64, 128):
        variants[f"median of {w}"] = lambda w=w: Calibrator(additive=True, factor_window=w)
    print(f"{len(rows)} admitted requests; best constant correction in hindsight: APE {oracle(rows):.3f}")
    for name, make in variants.items():
        r = replay(rows, make())
        print(f"{name:18s} APE {r['ape']:.3f} (logged {r['logged_ape']:.3f}; replay / logged {r['vs_logged']:.3f}, n {r['n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
