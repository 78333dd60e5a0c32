"""Issue 24's device run, one model per call: the serving benchmark (bench.serve) against
`splitserve up` on one GPU, in phases:

  split      rate sweep (x the peak: the highest rate meeting the SLO for 90% of requests, found
             by bench.serve --peak slo, or --peak-rps) with the SLO sent (admission) and, on
             the identical trace, without (A/B, back to back), then a mixed short/long trace at MIXED_FACTOR x
             peak with --prefill-on-decode never (always split)
  auto       the same mixed trace with --prefill-on-decode auto (conditional disaggregation)
  colocated  the sweep's absolute rates with the SLO sent, one engine doing both

    python -m lab.serve_sweep --model dummy:llama-3.1-8b --ttft-ms 500 --tpot-ms 50
    python -m lab.serve_sweep --replot OUT/serve-*.json   # PNGs where the run had no matplotlib
Each phase is skipped when --deadline-s would be passed. JSON + PNGs per bench run in
$SPLITSERVE_BENCH_DIR; the table at the end is built from them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.peer_servers import start_splitserve

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[sweep {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def bench(url: str, a, name: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.serve", "--url", url, "--name", name, "--timeout",
           str(a.request_timeout), "--peak-concurrency", str(a.peak_concurrency),
           "--ttft-ms", str(a.ttft_ms), "--tpot-ms", str(a.tpot_ms), *extra]
    say(" ".join(cmd[3:]))
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=a.deadline_s)
    print(out.stdout[-3000:], flush=True)
    path = [ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("results: ")]
    if not path:
        raise SystemExit(f"bench.serve failed (rc {out.returncode})")
    with open(path[-1]) as f:
        return json.load(f)


def up(a, flags: list[str]):
    say("up " + " ".join(flags))
    gpu = ["--prefill-gpu", "0", "--decode-gpu", "0"] if a.device == "cuda" else []
    return start_splitserve("splitserve", ["--model", a.model, "--dtype", a.dtype, *gpu, *flags],
                            a.ready_timeout)


def left(a) -> float:
    return a.deadline_s - (time.monotonic() - T0)


def rows(doc: dict, phase: str) -> list[dict]:
    out = []
    for r in doc["results"]["runs"]:
        s, g = r["summary"], r.get("gateway") or {}
        out.append(dict(phase=phase, label=r["label"], rate=r.get("rate"), offered=s["offered_rate"],
                        goodput=s["goodput_rps"], thr=s["throughput_rps"], tok_s=s["output_tok_s"],
                        att=s["slo_attainment_admitted"], rej=s["rejected"], err=s["errors"],
                        n=s["requests"], ttft_p50=s["ttft_ms_p50"], ttft_p99=s["ttft_ms_p99"],
                        tpot_p50=s["tpot_ms_p50"], tpot_p99=s["tpot_ms_p99"],
                        ttft_ape=g.get("ttft_prediction_abs_error_median"),
                        ttft_ape_req=s.get("ttft_prediction_ape_median"),  # per-request rows
                        ttft_ape_steady=s.get("ttft_prediction_ape_median_steady"),
                        tpot_ape=g.get("tpot_prediction_abs_error_median")))
    return out


def table(rs: list[dict]) -> None:
    hdr = ("phase", "label", "rate", "goodput", "thr", "tok/s", "att_adm", "rej", "err", "n",
           "ttft50", "ttft99", "tpot50", "tpot99", "ttftAPE", "ttftAPE_req", "ttftAPE_steady")
    print(" | ".join(hdr))
    for r in rs:
        f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(" | ".join([r["phase"], r["label"], f(r["rate"], 2), f(r["goodput"], 2), f(r["thr"], 2),
                          f(r["tok_s"], 0), f(r["att"], 3), str(r["rej"]), str(r["err"]), str(r["n"]),
                          f(r["ttft_p50"]), f(r["ttft_p99"]), f(r["tpot_p50"]), f(r["tpot_p99"]),
                          f(r["ttft_ape"], 3), f(r["ttft_ape_req"], 3),
                          f(r.get("ttft_ape_steady"), 3)]), flush=True)


def replot(paths: list[str]) -> None:
    """The PNGs of bench.serve JSONs written without matplotlib (CDFs from the per-request
    rows: no ITL, which the rows do not keep), and one load plot over all of them."""
    from bench.serve_plots import plot_cdfs, plot_load

    series: dict[str, list] = {}
    slo = {}
    for path in sorted(paths):
        doc = json.load(open(path))
        slo = {"ttft_ms": doc["config"]["ttft_ms"], "tpot_ms": doc["config"]["tpot_ms"]}
        cdf = {}
        for r in doc["results"]["runs"]:
            ok = [q for q in r["requests"] if q["status"] == "ok"]
            load = f"{r['rate']:.3g}/s" if "rate" in r else f"c={int(r['concurrency'])}"
            cdf[f"{r['label']} {load}"] = {m: [q[m] for q in ok if m in q]
                                           for m in ("ttft_ms", "tpot_ms", "e2e_ms")}
            if "rate" in r:
                series.setdefault(f"{doc['benchmark']}: {r['label']}", []).append(r["summary"])
        print(plot_cdfs(cdf, path[:-len(".json")] + "-cdf.png", doc["benchmark"], slo))
    multi = {k: v for k, v in series.items() if len(v) > 1}
    if multi:
        out = os.path.join(os.path.dirname(sorted(paths)[0]), "serve-sweep-load.png")
        print(plot_load(multi, out, slo=slo))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: both services on GPU 0; cpu: a dry run of this script")
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--preset", default="chat")
    p.add_argument("--factors", default="0.25,0.5,1,2,3")
    p.add_argument("--duration", type=float, default=10.0, help="s of arrivals per load point")
    p.add_argument("--peak-concurrency", type=int, default=64)
    p.add_argument("--peak-rps", type=float, default=None,
                   help="the peak of an earlier run (skips the search; phases auto, colocated alone)")
    p.add_argument("--peak-duration", type=float, default=8.0, help="s per peak-search probe")
    p.add_argument("--mixed-input", default="lognormal:256,1.2")
    p.add_argument("--mixed-factor", type=float, default=0.7, help="0: no mixed-trace runs")
    p.add_argument("--phases", default="split,auto,colocated")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--deadline-s", type=float, default=560.0)
    p.add_argument("--up-arg", action="append", default=[], help="extra `splitserve up` flag")
    p.add_argument("--replot", nargs="+", metavar="JSON", help="only draw the PNGs of these runs")
    a = p.parse_args(argv)
    if a.replot:
        replot(a.replot)
        return 0
    tag = a.model.split(":")[-1].replace(".", "")
    phases, rs, rates, mixed_rate = a.phases.split(","), [], None, None
    if a.peak_rps:
        rates = [float(f) * a.peak_rps for f in a.factors.split(",")]
        mixed_rate = a.mixed_factor * a.peak_rps
    mixed = ["--input-len", a.mixed_input, "--output-len", "fixed:64"]
    if "split" in phases:
        srv = up(a, a.up_arg)
        try:
            load = (["--rates", ",".join(f"{r:.3f}" for r in rates)] if rates else
                    ["--rates", "auto:" + a.factors, "--peak", "slo",
                     "--peak-duration", str(a.peak_duration)])
            doc = bench(srv.url, a, f"serve-{tag}-split", [
                "--preset", a.preset, *load, "--duration", str(a.duration),
                "--ab", "send_slo=false", "--ab-mode", "sequential", "--labels", "admission,none"])
            rs += rows(doc, "split")
            if not rates:
                peak = doc["config"]["peak_rps"]
                rates = [float(f) * peak for f in a.factors.split(",")]
                mixed_rate = a.mixed_factor * peak
                say(f"peak {peak:.2f} req/s ({doc['config']['peak']})")
            if mixed_rate and left(a) > 60:
                rs += rows(bench(srv.url, a, f"serve-{tag}-mixed-never", [
                    *mixed, "--rate", f"{mixed_rate:.3f}", "--duration", str(2 * a.duration)]), "never")
        finally:
            srv.stop()
    if "auto" in phases and mixed_rate and left(a) > 120:
        srv = up(a, [*a.up_arg, "--gateway-arg=--prefill-on-decode=auto"])
        try:
            rs += rows(bench(srv.url, a, f"serve-{tag}-mixed-auto", [
                *mixed, "--rate", f"{mixed_rate:.3f}", "--duration", str(2 * a.duration)]), "auto")
        finally:
            srv.stop()
    if "colocated" in phases and rates and left(a) > 150:
        srv = up(a, [*a.up_arg, "--topology", "colocated"])
        try:
            rs += rows(bench(srv.url, a, f"serve-{tag}-colocated", [
                "--preset", a.preset, "--rates", ",".join(f"{r:.3f}" for r in rates),
                "--duration", str(a.duration)]), "colocated")
        finally:
            srv.stop()
    table(rs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
