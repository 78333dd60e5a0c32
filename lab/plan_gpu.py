"""Issue 27's check of the planner's simulator against `splitserve up` split on ONE device, in
one device call per model (prefill and decode time-share GPU 0, as `up --prefill-gpu 0
--decode-gpu 0` deploys them):

  1. bench.engine_costs alone, then with one other engine decoding on the same device
     (--contend 1): the cost model and the contention stretch (rows over rows)
  2. splitserve up --topology split; bench.serve closed loop at c=1 (request / step overheads)
     and c=N (per-row overhead; its throughput sets the open-loop rates), then open loop at
     FRACTIONS x that throughput; every run its own trace seed (no prefix-cache hits across runs)
  3. bench.plan_validate on the open-loop runs: predicted vs measured P50 TTFT / TPOT / goodput,
     with the measured stretch and again with one fitted to the c=N run (--fit-contention)

    python -m lab.plan_gpu --model dummy:llama-3.2-1b                 # the lent GPU, ~300 s (est.)
    python -m lab.plan_gpu --model dummy:llama-3.1-8b --kv-cache-bytes 12884901888 --batches 1,8,32,64
    python -m lab.plan_gpu --device cpu --model dummy:tiny-llama --quick   # dry run on CPU

JSONs in $SPLITSERVE_BENCH_DIR (default bench/results); with --out DIR they, the logs and the
table also go to DIR/plan_gpu-<model>.tgz (one file for the device call to bring back).
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace

from lab.serve_sweep import bench, say, up

T0 = time.monotonic()
SLO = {"llama-3.2-1b": (250.0, 25.0), "llama-3.1-8b": (500.0, 50.0)}  # TTFT, TPOT ms


def sh(cmd: list[str], log: str, timeout: float) -> str:
    """Run a step, tee its output to `log`; its 'wrote PATH' line's path (or SystemExit)."""
    say(" ".join(cmd[2:]))
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    with open(log, "a") as f:
        f.write(out.stdout)
    print(out.stdout[-2500:], flush=True)
    wrote = [ln.split(" ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("wrote ")]
    if out.returncode or not wrote:
        raise SystemExit(f"{cmd[2]} failed (rc {out.returncode}); log {log}")
    return wrote[-1]


def served(doc: dict) -> dict:
    """The run's summary; SystemExit when nothing completed (a bad flag, not a slow server)."""
    s = doc["results"]["runs"][0]["summary"]
    if not s["completed"]:
        raise SystemExit(f"no request completed: {s['errors_by_code']}")
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="each engine's KV budget, two engines share the device (default 4 GiB on "
                   "cuda, 256 MiB on cpu); it must hold the largest --batches x --contexts")
    p.add_argument("--batches", default="1,8,32,64,128", help="engine_costs decode batches")
    p.add_argument("--contexts", default="256,768", help="engine_costs decode contexts")
    p.add_argument("--input-len", default="lognormal:192,0.8")
    p.add_argument("--output-len", default="lognormal:128,0.6")
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids below this")
    p.add_argument("--ttft-ms", type=float, default=None, help="SLO (default by model, else 500)")
    p.add_argument("--tpot-ms", type=float, default=None, help="SLO (default by model, else 50)")
    p.add_argument("--idle-requests", type=int, default=16)
    p.add_argument("--loaded-concurrency", type=int, default=32)
    p.add_argument("--fractions", default="0.4,0.7,0.95", help="open-loop rates x the c=N throughput")
    p.add_argument("--duration", type=float, default=10.0, help="s of arrivals an open-loop point")
    p.add_argument("--quick", action="store_true", help="tiny everything: a dry run of the script")
    p.add_argument("--deadline-s", type=float, default=560.0)
    p.add_argument("--out", default=os.environ.get("OUT"), help="tar everything here")
    a = p.parse_args(argv)
    shape = a.model.split(":")[-1]
    tag = shape.replace(".", "")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.kv_cache_bytes = a.kv_cache_bytes or ((4 << 30) if a.device == "cuda" else (256 << 20))
    slo = SLO.get(shape, (500.0, 50.0))
    a.ttft_ms, a.tpot_ms = a.ttft_ms or slo[0], a.tpot_ms or slo[1]
    res = os.environ.setdefault("SPLITSERVE_BENCH_DIR", "bench/results")
    os.makedirs(res, exist_ok=True)
    log = os.path.join(res, f"plan_gpu-{tag}.log")
    py = [sys.executable, "-m"]
    costs = ["--model", a.model, "--device", a.device, "--dtype", a.dtype, "--shape", shape,
             "--kv-cache-bytes", str(a.kv_cache_bytes), "--threads", "1", "--reps", "3"]
    if a.quick:
        costs += ["--prefill", "8,32", "--batches", "1,4", "--contexts", "8,32", "--mixed", "", "--reps", "1"]
        a.idle_requests, a.loaded_concurrency, a.duration = 4, 4, 2.0
        a.input_len, a.output_len, a.vocab = "lognormal:32,0.5", "lognormal:16,0.5", min(a.vocab, 500)
    else:
        costs += ["--prefill", "32,128,512,1024,2048", "--batches", a.batches,
                  "--contexts", a.contexts, "--mixed", "32x256+256"]
    alone = sh(py + ["bench.engine_costs", *costs], log, a.deadline_s)
    contended = sh(py + ["bench.engine_costs", *costs, "--contend", "1", "--contend-batch", "32",
                         "--contend-ctx", "256"], log, a.deadline_s)
    # lab.serve_sweep's helpers read these
    ns = SimpleNamespace(model=a.model, dtype=a.dtype, device=a.device, ready_timeout=240.0,
                         request_timeout=120.0, peak_concurrency=a.loaded_concurrency,
                         ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms, deadline_s=a.deadline_s)
    lens = ["--input-len", a.input_len, "--output-len", a.output_len, "--vocab", str(a.vocab),
            "--no-send-slo", "--no-plots"]
    flags = ["--topology", "split", "--kv-cache-bytes", str(a.kv_cache_bytes)]
    srv = up(ns, flags)
    runs = []
    try:
        served(bench(srv.url, ns, f"plan_idle-{tag}", [*lens, "--concurrency", "1", "--num-requests",
                                                        str(a.idle_requests), "--seed", "11"]))
        c = a.loaded_concurrency
        loaded = bench(srv.url, ns, f"plan_loaded-{tag}", [*lens, "--concurrency", str(c),
                                                           "--num-requests", str(5 * c), "--seed", "12"])
        thr = served(loaded)["throughput_rps"]
        say(f"c={c} throughput {thr:.2f} req/s")
        for i, f in enumerate(float(x) for x in a.fractions.split(",")):
            if a.deadline_s - (time.monotonic() - T0) < 3 * a.duration + 40:
                say(f"skipping {f}x and after: deadline")
                break
            runs.append(bench(srv.url, ns, f"plan_rate-{tag}", [*lens, "--rate", f"{f * thr:.3f}",
                                                                "--duration", str(a.duration),
                                                                "--seed", str(13 + i)]))
            served(runs[-1])
    finally:
        srv.stop()
    paths = {n: sorted(glob.glob(os.path.join(res, f"{n}-{tag}-*.json")))[-1] for n in ("plan_idle", "plan_loaded")}
    rate_paths = sorted(glob.glob(os.path.join(res, f"plan_rate-{tag}-*.json")))[-len(runs):] if runs else []
    if not rate_paths:
        raise SystemExit("no open-loop run to validate")
    check = [*rate_paths, "--calibration", alone, "--shape", shape, "--idle", paths["plan_idle"],
             "--loaded", paths["plan_loaded"], "--prefill", "1", "--decode", "1", "--devices", "1"]
    # measured stretch (engine vs engine on the device), then the one fitted to the c=N run's TTFT
    sh(py + ["bench.plan_validate", *check, "--contended", contended], log, 120)
    sh(py + ["bench.plan_validate", *check, "--fit-contention"], log, 120)
    say(f"done in {time.monotonic() - T0:.0f} s")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tgz = os.path.join(a.out, f"plan_gpu-{tag}.tgz")
        with tarfile.open(tgz, "w:gz") as t:
            for f in [alone, contended, log, *paths.values(), *rate_paths,
                      *sorted(glob.glob(os.path.join(res, "plan_validate-*.json")))[-2:]]:
                t.add(f, arcname=os.path.basename(f))
        say(f"wrote {tgz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
