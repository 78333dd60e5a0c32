"""What AsyncEngine adds to a prefill's time to first token, in one process: the raw Engine
(add_request, then step() until the first token) against AsyncEngine.generate(prefill_only=True)
driven from an event loop (uvloop when installed, as the services run), and the prefill
servicer's path (stream_kv_layers, then generate). Interleaved rounds, medians.

    python -m lab.async_hop_probe [--reps 200] [--prompt-lens 16] [--baseline OLD.py]
        [--gap-ms 3] [engine flags, default --model dummy:tiny-llama --device cpu]
        [--gil-switch-interval-ms MS]

Cases (ms; median and p90), per prompt length:
  raw_main    Engine on the main thread, no engine thread running
  raw_thread  the same inside one AsyncEngine.call, on the engine thread (the loop idles)
  generate    AsyncEngine.generate(prefill_only=True): the call -> its first output on the loop
  servicer    stream_kv_layers + generate, as prefill_svc/servicer.py's t_in -> t_first with a
              layer-streaming backend (a pool backend skips stream_kv_layers: that is `generate`)
  call_rtt    AsyncEngine.call(no-op) round trip
The engine is built from the flags as prefill_svc builds it (engine_config_from_args, prefix
caching on; prompts are random, so no cache hits). Every request is released before the next,
outside the timed window. --baseline FILE (e.g. `git show HEAD:engine/async_engine.py`) adds
the AsyncEngine cases for that copy of the module as base:*, interleaved round by round.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
import time

from bench.common import print_table, write_result
from common.service_args import add_engine_args, apply_switch_interval, engine_config_from_args
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
ASYNC_CASES = ("raw_thread", "generate", "servicer", "call_rtt")


def raw_one(eng: Engine, rid: str, prompt: list[int], gap_s: float = 0.0) -> float:
    if gap_s:
        time.sleep(gap_s)
    t = time.perf_counter()
    eng.add_request(rid, prompt, PARAMS, prefill_only=True)
    while True:
        outs = eng.step()
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            dt = time.perf_counter() - t
            break
    while eng.has_unfinished():
        eng.step()
    eng.release(rid)
    return dt


async def gen_one(ae, rid: str, prompt: list[int], layers: bool, gap_s: float = 0.0) -> float:
    if gap_s:
        await asyncio.sleep(gap_s)
    t = time.perf_counter()
    if layers:
        await ae.stream_kv_layers(rid, asyncio.Queue())
    first = None
    async for out in ae.generate(rid, prompt, PARAMS, prefill_only=True):
        if out.new_token_ids and first is None:
            first = time.perf_counter() - t
    await ae.release(rid)
    return first


async def call_one(ae, gap_s: float = 0.0) -> float:
    if gap_s:
        await asyncio.sleep(gap_s)
    t = time.perf_counter()
    await ae.call(lambda e: None)
    return time.perf_counter() - t


def load_impl(path: str, name: str):
    """AsyncEngine of another copy of engine/async_engine.py."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.AsyncEngine


async def measure(eng: Engine, impls: dict, plen: int, reps: int, rounds: int, warmup: int,
                  rng: random.Random, gap_s: float) -> dict[str, list[float]]:
    vocab = eng.arch.vocab_size
    lo = min(100, vocab // 4)
    times: dict[str, list[float]] = {"raw_main": []}
    times.update({tag + c: [] for tag in impls for c in ASYNC_CASES})
    seq = 0

    def batch(k):
        nonlocal seq
        seq += 1
        return [(f"p{plen}-{seq}-{i}", [rng.randrange(lo, vocab) for _ in range(plen)])
                for i in range(k)]

    k = max(1, reps // rounds)
    for rid, p in batch(warmup):
        raw_one(eng, rid, p)
    for r in range(rounds + 1):  # round 0 warms each implementation up and is dropped
        keep = r > 0
        xs = [raw_one(eng, rid, p, gap_s) for rid, p in batch(k)]
        times["raw_main"] += xs if keep else []
        for tag, cls in impls.items():
            # one engine thread at a time: an idle one would step the other's requests
            ae = cls(engine=eng)
            await ae.start()
            try:
                got = {c: [] for c in ASYNC_CASES}
                b = batch(k)
                got["raw_thread"] = await ae.call(
                    lambda e, b=b: [raw_one(e, rid, p, gap_s) for rid, p in b])
                await asyncio.sleep(0.01)  # the engine thread idle again, as between requests
                got["generate"] = [await gen_one(ae, rid, p, False, gap_s) for rid, p in batch(k)]
                got["servicer"] = [await gen_one(ae, rid, p, True, gap_s) for rid, p in batch(k)]
                got["call_rtt"] = [await call_one(ae, gap_s) for _ in range(k)]
            finally:
                await ae.stop()
            if keep:
                for c, xs in got.items():
                    times[tag + c] += xs
    return times


def _install_uvloop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--reps", type=int, default=200, help="requests per case and prompt length")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds of reps/rounds")
    ap.add_argument("--warmup", type=int, default=20, help="raw requests before round 0")
    ap.add_argument("--prompt-lens", default="16")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="idle time before every timed request, in every case (a service sees "
                         "gaps between requests: on a CPU the step after one runs colder)")
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--baseline", default=None,
                    help="another engine/async_engine.py to A/B against (its cases: base:*)")
    ap.add_argument("--candidate", default=None,
                    help="measure this copy of engine/async_engine.py instead of the tree's")
    ap.add_argument("--gil-switch-interval-ms", type=float, default=None,
                    help="as the services' flag (unset: Python's 5 ms)")
    ap.add_argument("--no-write", action="store_true")
    add_engine_args(ap)
    ap.set_defaults(model="dummy:tiny-llama", device="cpu")
    a = ap.parse_args(argv)
    cfg = engine_config_from_args(a, prefix_caching=True)  # as prefill_svc
    apply_switch_interval(a.gil_switch_interval_ms)
    loop_kind = "asyncio" if a.no_uvloop else _install_uvloop()
    impls = {"": load_impl(a.candidate, "async_engine_cand") if a.candidate else AsyncEngine}
    if a.baseline:
        impls = {"base:": load_impl(a.baseline, "async_engine_base"), **impls}
    lens = [int(x) for x in a.prompt_lens.split(",")]

    async def run_all():
        eng = Engine(cfg)
        rng = random.Random(0)
        return {n: await measure(eng, impls, n, a.reps, a.rounds, a.warmup, rng, a.gap_ms / 1e3)
                for n in lens}

    by_len = asyncio.run(run_all())
    print(f"loop={loop_kind} switchinterval={sys.getswitchinterval() * 1e3:g} ms "
          f"model={a.model} device={a.device} gap={a.gap_ms:g} ms")
    res, rows = {}, []
    for n, times in by_len.items():
        res[n] = {}
        for case, xs in times.items():
            xs = sorted(xs)
            med, p90 = statistics.median(xs) * 1e3, xs[int(len(xs) * 0.9)] * 1e3
            res[n][case] = {"median_ms": round(med, 4), "p90_ms": round(p90, 4), "n": len(xs)}
            rows.append({"prompt": n, "case": case, "median_ms": f"{med:.3f}",
                         "p90_ms": f"{p90:.3f}", "n": len(xs)})
        for tag in impls:
            gap = res[n][tag + "generate"]["median_ms"] - res[n][tag + "raw_thread"]["median_ms"]
            res[n][tag + "generate_minus_raw_ms"] = round(gap, 4)
            rows.append({"prompt": n, "case": f"{tag}generate - {tag}raw_thread",
                         "median_ms": f"{gap:.3f}"})
    print_table(rows, ["prompt", "case", "median_ms", "p90_ms", "n"])
    if not a.no_write:
        print(write_result("async_hop_probe", {
            "model": a.model, "device": a.device, "prompt_lens": lens, "loop": loop_kind,
            "switchinterval_ms": sys.getswitchinterval() * 1e3, "reps": a.reps, "gap_ms": a.gap_ms,
            "rounds": a.rounds, "baseline": a.baseline, "candidate": a.candidate}, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
