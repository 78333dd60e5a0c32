"""Serving benchmark: drive a running server (the splitserve gateway, or any OpenAI-compatible
URL) with a seeded request trace and report what clients get: TTFT / TPOT / ITL / e2e at
P50/P90/P99, SLO attainment, goodput, throughput, admission outcomes (completed / rejected with
Retry-After / errors; the gateway's admit / queue / reject counts and prediction error from its
/metrics), plus PNG plots. Also `splitserve bench`.

    python -m bench.serve --url http://127.0.0.1:8000 --preset chat --rate 2 --duration 60 \\
        --ttft-ms 2000 --tpot-ms 200
    python -m bench.serve --rates 1,2,4,8 --duration 30 ...          # a load sweep
    python -m bench.serve --rates auto:0.25,0.5,1,2,3 ...            # x the measured peak
    python -m bench.serve --concurrency 1,4,16 --num-requests 64 ... # closed loop
    python -m bench.serve --rate 2 --ab send_slo=false --ab-mode interleaved ...  # A/B

A/B: side B is side A with the `--ab KEY=VALUE,...` overrides (url, api, model, send_slo,
priority, ttft_ms, tpot_ms); both run the identical trace (same lengths, prefix groups and
arrival times; the same tokens too, unless both drive one URL: then B gets fresh tokens so it
does not hit the prefix cache A warmed, `--ab-prompts`), back to back (`sequential`) or in
`--ab-rounds` slices alternating A B / B A (`interleaved`, cancels drift). Per metric: KS test (scipy.stats.ks_2samp) and the P99 delta
B - A with a bootstrap interval. The SLO is always applied to the client's measurements;
`send_slo=false` only stops sending it (the gateway then admits everything).

JSON to bench/results/ (or $SPLITSERVE_BENCH_DIR) with every request's record; PNGs beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys

from bench.system_procs import scrape_metrics
from bench.serve_client import ClientConfig, make_client, run_load
from bench.serve_peak import measure_peak
from bench.serve_stats import compare, outcome_rows, samples, summarize
from bench.serve_trace import PRESETS, TraceSpec, arrival_times, build_trace, describe, trace_digest

DEFAULTS = dict(input_len="fixed:128", output_len="fixed:64", prefix_share=0.0, prefix_len=0,
                prefix_groups=1, arrival="poisson", burstiness=1.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="REST base URL, or host:port with --api grpc")
    p.add_argument("--api", choices=("completions", "chat", "grpc"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: ask the server)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, default=None, help="open loop, requests/s")
    g.add_argument("--rates", default=None, help="comma list, or auto:F1,F2 (x the measured peak)")
    g.add_argument("--concurrency", default=None, help="closed loop: comma list of client counts")
    g.add_argument("--arrival", choices=("poisson", "gamma"), default=None)
    g.add_argument("--burstiness", type=float, default=None, help="gamma shape (<1: burstier)")
    g.add_argument("--num-requests", type=int, default=None, help="per load point (default 100)")
    g.add_argument("--duration", type=float, default=None,
                   help="open loop: rate x duration requests per load point")
    g.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    g.add_argument("--peak", choices=("closed", "slo"), default="closed",
                   help="rates auto: the peak is closed-loop throughput, or the highest rate "
                   "meeting the SLO for --peak-attainment of requests (bench/serve_peak.py)")
    g.add_argument("--peak-concurrency", type=int, default=16, help="rates auto: closed loop size")
    g.add_argument("--peak-duration", type=float, default=8.0, help="--peak slo: s per probe")
    g.add_argument("--peak-attainment", type=float, default=0.9)
    t = p.add_argument_group("trace")
    t.add_argument("--input-len", default=None, help="fixed:N | uniform:LO,HI | lognormal:MEDIAN,SIGMA")
    t.add_argument("--output-len", default=None)
    t.add_argument("--prefix-share", type=float, default=None)
    t.add_argument("--prefix-len", type=int, default=None)
    t.add_argument("--prefix-groups", type=int, default=None)
    t.add_argument("--jsonl", default=None, help="local prompts, one JSON object a line")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab", type=int, default=None, help="token id range (default: ModelInfo "
                   "over gRPC, else 32000)")
    s = p.add_argument_group("SLO and A/B")
    s.add_argument("--ttft-ms", type=float, default=None)
    s.add_argument("--tpot-ms", type=float, default=None)
    s.add_argument("--no-send-slo", action="store_true", help="measure the SLO, do not send it")
    s.add_argument("--priority", type=int, default=None)
    s.add_argument("--ab", default=None, help="side B overrides, KEY=VALUE,...")
    s.add_argument("--ab-mode", choices=("sequential", "interleaved"), default="interleaved")
    s.add_argument("--ab-rounds", type=int, default=4)
    s.add_argument("--ab-prompts", choices=("auto", "same", "fresh"), default="auto",
                   help="B's token content: same as A's, or fresh tokens of the same lengths "
                   "(auto: fresh when both sides drive one URL, whose prefix cache A warmed)")
    s.add_argument("--labels", default="A,B")
    o = p.add_argument_group("output")
    o.add_argument("--metrics-url", default=None, help="Prometheus /metrics base URL (default: "
                   "--url for REST; off for gRPC)")
    o.add_argument("--name", default="serve")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    a = p.parse_args(argv)
    preset = PRESETS.get(a.preset, {})
    for k, v in DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, preset.get(k, v))
    if sum(x is not None for x in (a.rate, a.rates, a.concurrency)) > 1:
        p.error("give one of --rate, --rates, --concurrency")
    return a


def ab_overrides(spec: str | None, base: ClientConfig) -> ClientConfig | None:
    if not spec:
        return None
    kw = {}
    types = {f.name: f.type for f in dataclasses.fields(ClientConfig)}
    for item in spec.split(","):
        k, _, v = item.partition("=")
        k = k.strip()
        if k not in types or not _:
            raise SystemExit(f"--ab {item!r}: KEY=VALUE with KEY in {', '.join(types)}")
        t = types[k] if isinstance(types[k], str) else ""
        kw[k] = (v.lower() in ("1", "true", "yes", "on") if "bool" in t else
                 float(v) if "float" in t and v not in ("", "none") else
                 int(v) if "int" in t and v not in ("", "none") else None if v == "none" else v)
    return dataclasses.replace(base, **kw)


def scrape(url: str | None) -> dict[str, float]:
    """The gateway series the benchmark reports (empty when there is no /metrics)."""
    if not url:
        return {}
    try:
        return scrape_metrics(url, "splitserve_(?:admission|routing_prefix)")
    except OSError:
        return {}


def gateway_delta(before: dict, after: dict) -> dict:
    if not after:
        return {}

    def d(k):
        return after.get(k, 0.0) - before.get(k, 0.0)

    g = {dec: int(d(f'splitserve_admission_decisions_total{{decision="{dec}"}}'))
         for dec in ("admit", "queue", "reject")}
    for w in ("ttft", "tpot"):
        n = d(f'splitserve_admission_prediction_ratio_count{{what="{w}"}}')
        g[f"{w}_observed_over_predicted_mean"] = (
            d(f'splitserve_admission_prediction_ratio_sum{{what="{w}"}}') / n if n else None)
        g[f"{w}_prediction_abs_error_median"] = after.get(
            f'splitserve_admission_prediction_abs_error_ratio{{what="{w}"}}')
        for term in ("scale", "offset_ms"):
            g[f"{w}_correction_{term}"] = after.get(
                f'splitserve_admission_prediction_correction{{term="{term}",what="{w}"}}')
    pt = d('splitserve_routing_prefix_tokens_total{kind="prompt"}')
    g["routed_prefix_hit_rate"] = d('splitserve_routing_prefix_tokens_total{kind="cached"}') / pt if pt else None
    return g


async def run_point(cfg: ClientConfig, reqs, times, concurrency: int, label: str,
                    metrics_url: str | None):
    """One load point on one side (open loop at `times`, else closed loop) ->
    (outcomes, wall_s, gateway deltas)."""
    before = scrape(metrics_url)
    outs, wall = await run_load(cfg, reqs, times, concurrency, label)
    return outs, wall, gateway_delta(before, scrape(metrics_url))


def _slices(reqs, times, rounds: int):
    k = max(1, min(rounds, len(reqs)))
    step = math.ceil(len(reqs) / k)
    for i in range(0, len(reqs), step):
        sl, ts = reqs[i:i + step], (times[i:i + step] if times else None)
        yield sl, ([t - ts[0] for t in ts] if ts else None)


async def run_sides(sides, traces, times, point, a) -> list[tuple[list, float, dict]]:
    """Each side on its trace (the same shape for all); interleaved: slices in A B / B A
    order."""
    rounds = a.ab_rounds if len(sides) > 1 and a.ab_mode == "interleaved" else 1
    acc = [([], 0.0, {}) for _ in sides]
    parts = [list(_slices(t, times, rounds)) for t in traces]
    for j in range(len(parts[0])):
        order = list(range(len(sides)))[::(-1 if j % 2 else 1)]
        for i in order:
            label, cfg, murl = sides[i]
            sl, ts = parts[i][j]
            outs, wall, gw = await run_point(cfg, sl, ts, int(point[1]),
                                             f"{label} {point[0]} {point[1]:g}", murl)
            prev = acc[i]
            merged = {k: (prev[2].get(k) or 0) + v if isinstance(v, int) else v for k, v in gw.items()}
            acc[i] = (prev[0] + outs, prev[1] + wall, merged)
    return acc


def vocab_size(a) -> int:
    if a.vocab:
        return a.vocab
    if a.api == "grpc":
        import grpc

        from protos import generate_pb2, generate_pb2_grpc

        with grpc.insecure_channel(a.url) as ch:
            return generate_pb2_grpc.GenerationStub(ch).ModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=30).vocab_size
    return 32000


async def main_async(a) -> dict:
    from bench.serve_report import report

    base = ClientConfig(api=a.api, url=a.url, model=a.model, send_slo=not a.no_send_slo,
                        ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms, priority=a.priority,
                        timeout_s=a.timeout, api_key=a.api_key)
    if base.model is None:
        c = make_client(base)
        try:
            base.model = await c.model()
        finally:
            await c.close()
    b = ab_overrides(a.ab, base)
    fresh = b is not None and (a.ab_prompts == "fresh" or (a.ab_prompts == "auto" and b.url == base.url))
    la, lb = (a.labels.split(",") + ["A", "B"])[:2]
    murl = a.metrics_url or (a.url if a.api != "grpc" else None)
    sides = [(la, base, murl)] + ([(lb, b, a.metrics_url or (b.url if b.api != "grpc" else None))]
                                  if b else [])
    if a.concurrency:
        points = [("concurrency", float(c)) for c in a.concurrency.split(",")]
    elif a.rates and a.rates.startswith("auto:"):
        points = [("factor", float(f)) for f in a.rates[5:].split(",")]
    else:
        points = [("rate", float(r)) for r in (a.rates.split(",") if a.rates else [a.rate or 1.0])]
    per_point = a.num_requests or 100
    if a.duration and not a.concurrency:
        per_point = None  # from the rate
    spec = TraceSpec(num_requests=1, input_len=a.input_len, output_len=a.output_len,
                     prefix_share=a.prefix_share, prefix_len=a.prefix_len,
                     prefix_groups=a.prefix_groups, seed=a.seed, jsonl=a.jsonl)
    vocab = vocab_size(a)
    if a.warmup:
        warm = build_trace(dataclasses.replace(spec, num_requests=a.warmup, seed=a.seed + 7919), vocab)
        for label, cfg, _ in sides:
            await run_load(dataclasses.replace(cfg, send_slo=False), warm, None, 1, f"{label} warmup")
    peak = peak_info = None
    if points[0][0] == "factor":
        peak, peak_info = await measure_peak(base, spec, vocab, a)
        points = [("rate", f * peak) for _, f in points]
    runs, abs_ = [], []
    for k, point in enumerate(points):
        n = per_point or max(1, round(point[1] * a.duration))
        # NOTE: fresh token content per point (and side, on one URL): a point must not be
        # served from the prefix cache the previous one warmed; the shape stays the seed's
        reqs = build_trace(dataclasses.replace(spec, num_requests=n), vocab, 2 * k)
        times = arrival_times(n, point[1], a.arrival, a.burstiness, a.seed) if point[0] == "rate" else None
        traces = [reqs] + ([build_trace(dataclasses.replace(spec, num_requests=n), vocab, 2 * k + 1)
                            if fresh else reqs] if b else [])
        got = await run_sides(sides, traces, times, point, a)
        side_samples = []
        for (label, cfg, _), reqs, (outs, wall, gw) in zip(sides, traces, got):
            summ = summarize(outs, wall, a.ttft_ms, a.tpot_ms,
                             point[1] if point[0] == "rate" else None)
            runs.append({"label": label, point[0]: point[1], "summary": summ, "gateway": gw,
                         "client": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"},
                         "trace_digest": trace_digest(reqs, times),
                         "shape_digest": trace_digest(reqs, times, shape_only=True),
                         "requests": outcome_rows(outs),
                         "_samples": samples(outs)})
            side_samples.append(runs[-1]["_samples"])
        if b:
            abs_.append({"point": {point[0]: point[1]}, "labels": [la, lb],
                         "compare": compare(*side_samples, seed=a.seed), "mode": a.ab_mode})
    cfg = {k: v for k, v in vars(a).items() if k != "api_key"}
    cfg.update(trace=describe(build_trace(dataclasses.replace(spec, num_requests=per_point or 8), vocab)),
               peak_rps=peak, peak=peak_info, vocab=vocab)
    return report(a, cfg, runs, abs_)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        asyncio.run(main_async(a))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
