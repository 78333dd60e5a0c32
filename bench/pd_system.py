"""The whole system (`splitserve up`: gateway + prefill + decode) against its engine alone, the
same cases with the same flags, in one run (issue 23).

    python -m bench.pd_system --model default --device cpu --clients 4 --prompt-len 32 \\
        --max-tokens 16 --ttft-prompts 16,64 --reps 2
    python -m bench.pd_system --model dummy:llama-3.1-8b --device cuda [--kv-backend auto|vmm|grpc]

1. The engine alone: an in-process Engine built from the engine flags (common/service_args.py,
   as a colocated engine: role and prefix caching as prefill's; prompts are random, so no cache
   hits), CUDA graphs captured at build, a warm-up, then: TTFT (add_request -> first token) of
   one request per --ttft-prompts length (clipped to max_model_len), median of --reps; --clients
   concurrent requests (--prompt-len random tokens, --max-tokens out, ignore_eos, greedy):
   output tokens/s, TPOT, inter-token gaps (whole run, and after every first token is out);
   TPOT of --lp-batch requests with logprobs off and on. Then the engine is freed.
2. The system: `python -m splitserve_cli up` with the same flags (on CUDA both services on the
   engine's GPU: --prefill-gpu N --decode-gpu N, and --kv-cache-bytes, default 16 GiB each,
   unless --num-blocks / --kv-cache-bytes is given: gpu-memory-utilization budgets free memory
   at start-up, which two engines starting together on one GPU would race for), free ports,
   --kv-backend passed as --kv-transfer-backend. The same cases through the gateway, measured
   by streaming clients: --api grpc (default: Generate with token ids in and out, skip_text,
   so every token's arrival is seen) or --api rest (/v1/completions SSE, prompt as token ids;
   a token whose text is empty is not sent as a chunk, e.g. most tokens of a dummy model, so
   gaps are per chunk there). KV bytes and backend per request come from prefill's Prometheus
   metrics (the gateway's responses do not carry them).
3. One table (ratio: system / engine; TTFT: system / (engine + 5 ms)); JSON with all figures
   in bench/results/pd_system-<UTC stamp>.json (SPLITSERVE_BENCH_DIR overrides the folder).
A case that fails shows 'error: ...' in its cell; the rest goes on. `up` is always stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench.client_pool import ClientPool
from bench.common import print_table, write_result
from bench.pd_hops import itl_means, role_pids, snapshot
from bench.pd_table import (COLS, TTFT_SLACK_MS, add_derived, build_rows, fmt,  # noqa: F401
                             ratio)  # fmt, ratio: re-exported
from bench.pd_clients import (gateway_medians, percentile, random_prompts, run_engine, run_system,
                               trace_stats)
from bench.system_procs import free_port, kv_delta, model_info, scrape, stop_process, wait_up

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_KV_BYTES = 16 << 30


def say(msg: str) -> None:
    print(f"[pd_system {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    from common.service_args import add_engine_args

    ap = argparse.ArgumentParser(prog="python -m bench.pd_system", allow_abbrev=False,
                                 description="the whole system vs its engine alone",
                                 epilog="Other flags are engine flags (common/service_args.py: "
                                        "--model, --device, --dtype, --block-size, --max-num-seqs, "
                                        "--kv-cache-dtype, ...), given to both sides.")
    ap.add_argument("--ttft-prompts", default="128,512,2048,8192")
    ap.add_argument("--reps", type=int, default=5, help="TTFT: median of this many requests")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lp-batch", type=int, default=4, help="requests in the logprobs cases")
    ap.add_argument("--logprobs", type=int, default=1, help="top-N in the logprobs-on case")
    ap.add_argument("--kv-backend", choices=("auto", "grpc", "dist", "nixl", "vmm", "shm"), default=None)
    ap.add_argument("--api", choices=("grpc", "rest"), default="grpc")
    ap.add_argument("--prefill-on-decode", choices=("never", "auto", "always"), default=None,
                    help="the gateway's choice (default: its own, auto)")
    ap.add_argument("--decode-streams", choices=("many", "per-request"), default=None,
                    help="the gateway's --decode-streams (default: the gateway's default)")
    ap.add_argument("--topology", choices=("split", "colocated", "auto"), default="split",
                    help="up's topology (split: the disaggregated system this compares; "
                         "auto colocates on CPU)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes the system's streams are spread over (1: all in this "
                         "process, whose loop may then set the pace of short steps)")
    ap.add_argument("--client-channels", type=int, default=1,
                    help="gRPC connections per client process, its streams dealt over them (each "
                         "its own connection: gateway workers get them spread by the kernel)")
    ap.add_argument("--gateway-workers", type=int, default=1,
                    help="up's --gateway-workers: gateway processes sharing the ports")
    ap.add_argument("--up-arg", action="append", default=[],
                    help="one more `splitserve up` flag for the system only (repeat; "
                         "e.g. --up-arg=--decode-arg=--gil-switch-interval-ms=0.5)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    a, rest = ap.parse_known_args(argv)
    ep = argparse.ArgumentParser(prog="engine flags", allow_abbrev=False)
    add_engine_args(ep)
    e = ep.parse_args(rest)
    if e.device == "auto":
        import torch

        e.device = "cuda" if torch.cuda.is_available() else "cpu"
    if e.device.startswith("cuda") and e.num_blocks is None and e.kv_cache_bytes is None:
        rest += ["--kv-cache-bytes", str(GPU_KV_BYTES)]
        e.kv_cache_bytes = GPU_KV_BYTES
    return a, e, rest


def without_device(argv: list[str]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--device":
            skip = True
        elif not x.startswith("--device="):
            out.append(x)
    return out


def guarded(fn):
    try:
        return fn()
    except Exception as ex:  # noqa: BLE001 - the cell says what went wrong, the run goes on
        say(f"  failed: {type(ex).__name__}: {ex}")
        return f"error: {type(ex).__name__}: {ex}"


def ttft_lens(spec: str, max_model_len: int) -> list[int]:
    """--ttft-prompts clipped so a prompt leaves room for its 2 tokens; duplicates dropped."""
    return list(dict.fromkeys(min(int(x), max_model_len - 2) for x in spec.split(",") if x.strip()))


def run_cases(run, a, vocab: int, max_model_len: int, seed: int, side: str, probe=None) -> dict:
    """The cases, one side. run(prompts, max_tokens, logprobs) -> traces; probe(): a snapshot
    of counters (system: prefill's KV metrics) taken around the load case."""
    res: dict = {}
    lens = ttft_lens(a.ttft_prompts, max_model_len)
    say(f"{side}: warm-up")
    guarded(lambda: run(random_prompts(min(a.clients, 8), a.prompt_len, vocab, seed + 1), 8, None))
    for i, n in enumerate(lens):
        guarded(lambda: run(random_prompts(1, n, vocab, seed + 2 + i), 2, None))

    def ttft(n: int, s: int) -> dict:
        trs = [run(random_prompts(1, n, vocab, s * 1000 + r), 2, None)[0] for r in range(a.reps)]
        ms = [(tr.events[0][0] - tr.t_send) * 1e3 for tr in trs]
        # the gateway's breakdown (system, gRPC API)
        return {"ms_median": percentile(ms, 50), "samples_ms": [round(x, 3) for x in ms],
                **gateway_medians(trs)}

    before = guarded(probe) if probe else None
    for i, n in enumerate(lens):
        say(f"{side}: TTFT, {n}-token prompt x {a.reps}")
        res[f"ttft_{n}"] = guarded(lambda: ttft(n, seed + 100 + i))
    if probe:
        res["kv_ttft"] = guarded(lambda: kv_delta(before, probe(), a.reps * len(lens)))
    say(f"{side}: {a.clients} clients x {a.prompt_len}-token prompts, {a.max_tokens} tokens out")
    before = guarded(probe) if probe else None
    res["load"] = guarded(lambda: trace_stats(
        run(random_prompts(a.clients, a.prompt_len, vocab, seed + 200), a.max_tokens, None)))
    if probe:
        after = guarded(probe)
        res["kv"] = guarded(lambda: kv_delta(before, after, a.clients))
        res["hops"] = guarded(lambda: itl_means(before, after))
    for i, (key, lp) in enumerate((("lp_off", None), ("lp_on", a.logprobs))):
        say(f"{side}: {a.lp_batch} requests, logprobs {'off' if lp is None else lp}")
        res[key] = guarded(lambda: trace_stats(
            run(random_prompts(a.lp_batch, a.prompt_len, vocab, seed + 300 + i), a.max_tokens, lp)))
    return res


# ---- the engine alone ----------------------------------------------------------------------

def engine_side(a, e) -> dict:
    from common.service_args import engine_config_from_args
    from engine.engine import Engine

    say(f"engine alone: building {e.model} on {e.device}")
    eng = Engine(engine_config_from_args(e))
    try:
        return run_cases(lambda p, n, lp: run_engine(eng, p, n, lp), a, eng.arch.vocab_size,
                         eng.max_model_len, e.seed, "engine alone")
    finally:
        del eng
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- the whole system ----------------------------------------------------------------------

def start_up(a, e, engine_argv: list[str], log_path: str, mports: tuple[int, int]):
    cmd = [sys.executable, "-m", "splitserve_cli", "up", "--http-port", "0", "--grpc-port", "0",
           "--prefill-port", "0", "--decode-port", "0", "--ready-timeout", str(a.ready_timeout),
           "--metrics-ports", f"{mports[0]},{mports[1]}", "--topology", a.topology]
    if e.device.startswith("cuda"):
        gpu = e.device.partition(":")[2] or "0"
        cmd += ["--prefill-gpu", gpu, "--decode-gpu", gpu, *without_device(engine_argv)]
    else:
        cmd += engine_argv
    if a.kv_backend:
        cmd += ["--kv-transfer-backend", a.kv_backend]
    if a.prefill_on_decode:
        cmd += [f"--gateway-arg=--prefill-on-decode={a.prefill_on_decode}"]
    if a.decode_streams:
        cmd += [f"--gateway-arg=--decode-streams={a.decode_streams}"]
    if a.gateway_workers > 1:
        cmd += ["--gateway-workers", str(a.gateway_workers)]
    cmd += a.up_arg
    path = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path, "OTEL_TRACES_EXPORTER": "none"}
    say("whole system: " + " ".join(cmd[1:]))
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """Linux: `up` gets SIGTERM should this process die without its finally (SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def system_side(a, e, engine_argv: list[str]) -> tuple[dict, str]:
    """-> (results, the tail of up's log)."""
    log_path = tempfile.mkstemp(prefix="pd_system-up-", suffix=".log")[1]
    mports = (free_port(), free_port())
    up = start_up(a, e, engine_argv, log_path, mports)
    try:
        rest, grpc_addr = wait_up(up, log_path, a.ready_timeout)
        info = model_info(grpc_addr)
        say(f"whole system: up (REST {rest}, gRPC {grpc_addr})")
        addr = grpc_addr if a.api == "grpc" else rest

        pool = ClientPool(a.client_procs, a.client_channels) if a.client_procs > 1 else None

        def run(prompts, max_tokens, lp):
            if pool is not None:
                return pool.run(a.api, addr, info.model, prompts, max_tokens, lp)
            return asyncio.run(run_system(a.api, addr, info.model, prompts, max_tokens, lp,
                                          channels=a.client_channels))

        hops = {"decode": f"http://127.0.0.1:{mports[1]}", "gateway": rest}
        pids = role_pids(up.pid)
        if pool is not None:  # the client's share is its workers'
            pids.pop("client")
        try:
            res = run_cases(run, a, info.vocab_size, info.max_model_len, e.seed, "whole system",
                            probe=lambda: {**scrape(mports[0]), **scrape(mports[1]),
                                           **snapshot(hops, pids)})
        finally:
            if pool is not None:
                pool.close()
    except Exception as ex:  # noqa: BLE001 - every system cell says why
        say(f"whole system failed: {ex}")
        res = {"error": f"error: {type(ex).__name__}: {ex}"}
    finally:
        say("whole system: stopping `up`")
        stop_process(up, 60)
        tail = open(log_path).read()[-4000:]
        os.unlink(log_path)
    return res, tail


def main(argv=None) -> int:
    a, e, engine_argv = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop `up`
    import logging

    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    eng = guarded(lambda: engine_side(a, e))
    eng = add_derived({"error": eng} if isinstance(eng, str) else eng)
    sysr, up_tail = system_side(a, e, engine_argv)
    add_derived(sysr)
    rows = build_rows(eng, sysr, a)
    print(f"pd_system: {e.model} on {e.device}, {a.api} clients ({a.client_procs} processes), KV transfer "
          f"{a.kv_backend or 'default'}, prefill on decode {a.prefill_on_decode or 'default'}, "
          f"decode streams {a.decode_streams or 'default'}; ratio = system / engine "
          f"(TTFT: system / (engine + {TTFT_SLACK_MS:.0f} ms))")
    print_table(rows, COLS)
    for k, v in sorted(sysr.items()):  # where the system's first token went (gateway's account)
        if (k.startswith("ttft_") or k == "load") and isinstance(v, dict) and "gateway_ttft_ms_median" in v:
            what = f"{k[5:]} tokens" if k != "load" else f"{a.clients} clients"
            print(f"system TTFT {what} (gateway timings, median ms): " + ", ".join(
                f"{p} {v[f'gateway_{p}_ms_median']:.2f}" for p in ("ttft", "queue", "prefill", "transfer")))
    sys.stdout.flush()
    config = {"argv": sys.argv[1:] if argv is None else list(argv), "engine_flags": vars(e),
              "bench": vars(a), "engine_argv": engine_argv, "ttft_slack_ms": TTFT_SLACK_MS}
    path = write_result("pd_system", config, {"engine": eng, "system": sysr, "table": rows,
                                              "up_log_tail": up_tail,
                                              "wall_s": round(time.monotonic() - t0, 1)})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
