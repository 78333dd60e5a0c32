"""bench/serve.py's output: the tables on stdout, the JSON (bench.common.write_result) and the
PNGs beside it (<json stem>-cdf.png, -load.png when there are several open-loop load points,
-ab-<i>.png per A/B comparison); the JSON lists the PNGs under results.plots."""
from __future__ import annotations

import json
import math
import sys

from bench.common import print_table, write_result


def _f(x, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def run_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        s, g = r["summary"], r.get("gateway") or {}
        load = (f"{r['rate']:.3g} req/s" if "rate" in r else f"{int(r['concurrency'])} clients")
        # the median APE of this run's own requests (gateway workers each export their own
        # recent error, and /metrics shows the worst), else the gateway's
        ape = s.get("ttft_prediction_ape_median")
        if ape is None or (isinstance(ape, float) and math.isnan(ape)):
            ape = g.get("ttft_prediction_abs_error_median")
        rows.append({
            "run": r["label"], "load": load, "done": s["completed"], "rej": s["rejected"],
            "err": s["errors"], "goodput": _f(s["goodput_rps"], 3), "thru": _f(s["throughput_rps"], 3),
            "tok/s": _f(s["output_tok_s"]), "SLO%": _f(100 * s["slo_attainment"]),
            "SLO% adm": _f(100 * s["slo_attainment_admitted"]),
            "TTFT p50/p99": f"{_f(s['ttft_ms_p50'], 0)}/{_f(s['ttft_ms_p99'], 0)}",
            "TPOT p50/p99": f"{_f(s['tpot_ms_p50'])}/{_f(s['tpot_ms_p99'])}",
            "ITL p99": _f(s["itl_ms_p99"]), "e2e p99": _f(s["e2e_ms_p99"], 0),
            "adm/q/rej": (f"{g['admit']}/{g['queue']}/{g['reject']}" if "admit" in g else "-"),
            "TTFT err": _f(100 * ape, 0) + "%" if ape is not None else "-",
            "hit": _f(s["prefix_cache_hit_rate"], 2)})
    return rows


def ab_rows(ab: dict) -> list[dict]:
    rows = []
    for m, c in ab["compare"].items():
        if "p99_a" not in c:
            continue
        rows.append({"metric": m, "n A/B": f"{c['n_a']}/{c['n_b']}", "P50 A": _f(c["p50_a"]),
                     "P50 B": _f(c["p50_b"]), "P99 A": _f(c["p99_a"]), "P99 B": _f(c["p99_b"]),
                     "P99 B-A [95% CI]": f"{_f(c['p99_delta'])} [{_f(c['p99_delta_lo'])}, "
                                         f"{_f(c['p99_delta_hi'])}]",
                     "KS D": _f(c["ks_stat"], 3), "KS p": f"{c['ks_p']:.3g}"})
    return rows


def plots(a, base: str, runs: list[dict], abs_: list[dict], sams: list[dict]) -> list[str]:
    from bench.serve_plots import plot_ab, plot_cdfs, plot_load

    slo = {"ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms}
    out = []
    cdf = {}
    for r, sm in zip(runs, sams):
        load = f"{r['rate']:.3g}/s" if "rate" in r else f"c={int(r['concurrency'])}"
        cdf[f"{r['label']} {load}"] = sm
    out.append(plot_cdfs(cdf, base + "-cdf.png", f"latency CDFs ({a.name})", slo))
    series: dict[str, list] = {}
    for r in runs:
        if "rate" in r:
            series.setdefault(r["label"], []).append(r["summary"])
    if any(len(v) > 1 for v in series.values()):
        out.append(plot_load(series, base + "-load.png", slo=slo))
    for i, ab in enumerate(abs_):
        pt = ", ".join(f"{k} {v:.3g}" for k, v in ab["point"].items())
        out.append(plot_ab(ab["compare"], f"{base}-ab-{i}.png", tuple(ab["labels"]),
                           f"A/B at {pt} ({ab['mode']}): {ab['labels'][0]} vs {ab['labels'][1]}"))
    return out


def report(a, cfg: dict, runs: list[dict], abs_: list[dict]) -> dict:
    """runs: one dict per (load point, side), its latency samples under "_samples" (plotted,
    not written)."""
    sams = [r.pop("_samples") for r in runs]
    print_table(run_rows(runs), list(run_rows(runs[:1])[0].keys()) if runs else [])
    for ab in abs_:
        pt = ", ".join(f"{k} {v:.3g}" for k, v in ab["point"].items())
        print(f"\nA/B at {pt} ({ab['mode']}): {ab['labels'][0]} vs {ab['labels'][1]}, ms")
        rows = ab_rows(ab)
        if rows:
            print_table(rows, list(rows[0].keys()))
    results = {"runs": runs, "ab": abs_}
    path = write_result(a.name, cfg, results)
    if not a.no_plots:
        try:
            pngs = plots(a, path[:-len(".json")], runs, abs_, sams)
        except ImportError as e:  # matplotlib is a bench-only dependency
            print(f"no plots: {e}", file=sys.stderr)
            pngs = []
        with open(path) as f:
            doc = json.load(f)
        doc["results"]["plots"] = pngs
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        for p in pngs:
            print(f"plot: {p}")
    print(f"results: {path}")
    return {"path": path, "runs": runs, "ab": abs_}
