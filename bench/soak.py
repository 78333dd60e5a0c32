"""Soak: N minutes of open-loop load through the gateway, watching for what only time shows.

    python -m bench.soak --minutes 30 --rate 2 [--input-len uniform:16,256 --output-len fixed:32]
    python -m bench.soak --minutes 30 --load 0.8     # 80% of the capacity measured first
        [-- <splitserve up flags>]                 # starts `splitserve up` itself (default model)
    python -m bench.soak --url http://127.0.0.1:8000 --up-pid PID ...   # an `up` already running

Without --rate, capacity is measured first: --capacity-requests requests closed-loop at
--capacity-concurrency (completed / s), and the rate is --load times that.
Requests (bench/serve_trace.py, cycled) are sent on Poisson arrivals at --rate through REST
completions SSE (bench/serve_client.py). Every --sample-s: completions, rejections (429) and
errors in the window, the RSS of each of up's children (psutil) and the KV usage of each
replica (the gateway's /metrics). Lost = sent, but neither finished nor failed within
--grace-s after the load ends (a hung stream). After the load, KV usage must fall back to 0.
RSS growth = last sample vs the first sample after the warm-up (--warmup-frac of the run).
JSON (bench/common.write_result) and a PNG next to it in bench/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time

from bench.common import write_result
from bench.system_procs import scrape_metrics, stop_process, wait_up
from bench.serve_client import ClientConfig, RestClient, run_closed
from bench.serve_trace import TraceSpec, build_trace

DEFAULT_UP = ["--model", "default", "--device", "cpu", "--http-port", "0", "--grpc-port", "0",
              "--prefill-port", "0", "--decode-port", "0", "--metrics-ports", "0,0"]
_ROLE = {"prefill_svc": "prefill", "decode_svc": "decode", "gateway": "gateway"}


def children(up_pid: int) -> dict[str, int]:
    """role -> pid of `up`'s children."""
    import psutil

    out = {}
    for p in psutil.Process(up_pid).children():
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        mod = cmd[2] if len(cmd) > 2 and cmd[1] == "-m" else ""
        if mod in _ROLE:
            out[_ROLE[mod]] = p.pid
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for role, pid in pids.items():
        try:
            out[role] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            out[role] = float("nan")  # restarted or gone
    return out


def kv_usage(url: str) -> dict[str, float]:
    try:
        m = scrape_metrics(url, "splitserve_replica_kv_cache_usage_ratio")
    except OSError:
        return {}
    return {re.search(r'role="(\w+)"', k).group(1): v for k, v in m.items()}


async def capacity_rps(client, reqs, concurrency: int) -> float:
    """Completed requests / s of a closed loop at `concurrency` (what the server sustains)."""
    outs, wall = await run_closed(client, reqs, concurrency, "capacity")
    return sum(o.status == "ok" for o in outs) / wall


async def soak(url: str, up_pid: int | None, rate: float | None, minutes: float, spec: TraceSpec,
               sample_s: float, grace_s: float, load: float = 0.8, cap_requests: int = 32,
               cap_concurrency: int = 8) -> dict:
    client = RestClient(ClientConfig(api="completions", url=url, send_slo=False, timeout_s=3600))
    client.cfg.model = await client.model()
    reqs = build_trace(spec)
    capacity = None
    if rate is None:
        capacity = await capacity_rps(client, reqs[:cap_requests], cap_concurrency)
        rate = load * capacity
        print(f"soak: capacity {capacity:.3f} req/s; load {rate:.3f} req/s", file=sys.stderr)
    rng = random.Random(spec.seed)
    t0 = time.monotonic()
    end = t0 + minutes * 60
    pending: set[asyncio.Task] = set()
    done: list = []
    window = {"ok": 0, "rejected": 0, "error": 0}
    samples: list[dict] = []
    pids = children(up_pid) if up_pid else {}

    def finished(task: asyncio.Task) -> None:
        pending.discard(task)
        if task.cancelled():
            return
        o = task.result()
        done.append(o)
        window[o.status] += 1

    async def sampler():
        while True:
            await asyncio.sleep(sample_s)
            kv = await asyncio.to_thread(kv_usage, url)
            samples.append({"t_s": round(time.monotonic() - t0, 2), **{k: v for k, v in window.items()},
                            "in_flight": len(pending), "rss_mb": rss_mb(pids), "kv_usage": kv})
            for k in window:
                window[k] = 0

    smp = asyncio.ensure_future(sampler())
    sent, i, nxt = 0, 0, t0
    while nxt < end:
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        t = asyncio.ensure_future(client.send(reqs[i % len(reqs)]))
        t.add_done_callback(finished)
        pending.add(t)
        sent, i = sent + 1, i + 1
        nxt += rng.expovariate(rate)
    t_load = time.monotonic() - t0
    if pending:
        await asyncio.wait(set(pending), timeout=grace_s)
    lost = len(pending)
    for t in list(pending):
        t.cancel()
    kv_end, t_kv = {}, time.monotonic()
    while time.monotonic() - t_kv < 30:  # KV back to 0 (the gateway polls every 0.5 s)
        kv_end = await asyncio.to_thread(kv_usage, url)
        if kv_end and all(v == 0 for r, v in kv_end.items() if r == "decode"):
            break
        await asyncio.sleep(0.5)
    smp.cancel()
    await client.close()
    return {**summarize(samples, done, sent, lost, t_load, kv_end, rate, minutes),
            "capacity_rps": capacity}


def summarize(samples, done, sent, lost, t_load, kv_end, rate, minutes) -> dict:
    from bench.pd_clients import percentile

    ok = [o for o in done if o.status == "ok"]
    e2e = [o.t_end - o.t_send for o in ok]
    ttft = [o.events[0][0] - o.t_send for o in ok if o.events]
    errors = [o for o in done if o.status == "error"]
    during = [s for s in samples if s["t_s"] <= t_load]
    growth = {}
    if during:
        warm = during[min(len(during) - 1, max(1, len(during) // 5))]
        last = during[-1]
        for role, mb in last["rss_mb"].items():
            base = warm["rss_mb"].get(role)
            if base:
                growth[role] = round((mb - base) / base * 100, 2)
    return {"rate_rps": rate, "minutes": minutes, "load_s": round(t_load, 1), "sent": sent,
            "completed": len(ok), "rejected": sum(o.status == "rejected" for o in done),
            "errors": len(errors), "lost": lost,
            "error_examples": sorted({f"{o.code}: {o.error[:120]}" for o in errors})[:5],
            "throughput_rps": round(len(ok) / t_load, 3) if t_load else 0.0,
            "e2e_s_p50": percentile(e2e, 50), "e2e_s_p99": percentile(e2e, 99),
            "ttft_s_p50": percentile(ttft, 50), "ttft_s_p99": percentile(ttft, 99),
            "rss_growth_pct_after_warmup": growth, "kv_usage_end": kv_end, "samples": samples}


def plot(res: dict, path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for key, style in (("ok", "-"), ("rejected", "--"), ("error", ":")):
        axes[0].plot(t, [x[key] for x in s], style, label=key)
    axes[0].plot(t, [x["in_flight"] for x in s], "-.", label="in flight")
    axes[0].set_ylabel("requests / sample")
    for role in sorted({r for x in s for r in x["rss_mb"]}):
        axes[1].plot(t, [x["rss_mb"].get(role, float("nan")) for x in s], label=role)
    axes[1].set_ylabel("RSS (MiB)")
    for role in sorted({r for x in s for r in x["kv_usage"]}):
        axes[2].plot(t, [x["kv_usage"].get(role, float("nan")) * 100 for x in s], label=role)
    axes[2].set_ylabel("KV usage (%)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    up_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=None, help="requests / s (Poisson arrivals)")
    p.add_argument("--load", type=float, default=0.8, help="without --rate: this x measured capacity")
    p.add_argument("--capacity-requests", type=int, default=32)
    p.add_argument("--capacity-concurrency", type=int, default=8)
    p.add_argument("--input-len", default="uniform:16,256")
    p.add_argument("--output-len", default="fixed:32")
    p.add_argument("--num-prompts", type=int, default=200, help="distinct requests, cycled")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--grace-s", type=float, default=60.0)
    p.add_argument("--url", default=None, help="a running gateway's REST base URL")
    p.add_argument("--up-pid", type=int, default=None, help="its `splitserve up` pid (RSS)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    spec = TraceSpec(num_requests=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
                     seed=a.seed)
    proc = None
    url, up_pid = a.url, a.up_pid
    if url is None:
        log = os.path.join(tempfile.mkdtemp(prefix="soak-"), "up.log")
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "splitserve_cli", "up",
                                     *(up_args or DEFAULT_UP)], stdout=f, stderr=subprocess.STDOUT)
        url, _ = wait_up(proc, log, 600)
        up_pid = proc.pid
        print(f"soak: `splitserve up` at {url} (log {log})", file=sys.stderr)
    try:
        res = asyncio.run(soak(url, up_pid, a.rate, a.minutes, spec, a.sample_s, a.grace_s,
                               a.load, a.capacity_requests, a.capacity_concurrency))
    finally:
        if proc is not None:
            stop_process(proc, 60)
    cfg = {**vars(a), "up_args": up_args or (DEFAULT_UP if a.url is None else None)}
    path = write_result("soak", cfg, res)
    res["plot"] = plot(res, path[:-5] + ".png",
                       f"soak: {res['rate_rps']:.3g} req/s for {a.minutes:g} min, {res['completed']} ok, "
                       f"{res['errors']} errors, {res['lost']} lost")
    write_result_plot(path, res["plot"])
    print(f"sent {res['sent']}  completed {res['completed']}  rejected {res['rejected']}  "
          f"errors {res['errors']}  lost {res['lost']}  e2e p50 {res['e2e_s_p50']:.2f} s  "
          f"RSS growth after warm-up {res['rss_growth_pct_after_warmup']} %  "
          f"KV at the end {res['kv_usage_end']}\n{path}\n{res['plot']}")
    return 0 if res["lost"] == 0 and res["errors"] == 0 else 1


def write_result_plot(json_path: str, png: str) -> None:
    """Record the PNG's path in the JSON written before it."""
    import json

    with open(json_path) as f:
        doc = json.load(f)
    doc["results"]["plot"] = os.path.relpath(png, os.path.dirname(json_path))
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
