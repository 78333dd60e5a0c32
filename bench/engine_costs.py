"""Engine step costs for the planner's calibration (planner/calibration.py): prefill of N
tokens, a decode step of B rows at context C, and a few mixed steps (B decode rows plus one
N-token prompt) to check how the planner composes them. Every time is one Engine.step
(scheduling, forward, sampling, detokenizing), median over --reps.

    python -m bench.engine_costs [--device cpu] [--threads 2] [--prefill 16,64,...]
        [--batches 1,4,8,16,32] [--contexts 32,256] [--mixed 8x64+128,...] [--contend 1]

--contend K: the same rows timed while K other engine processes on the same device (CPU cores
or one GPU) decode back to back (--contend-batch rows at --contend-ctx); their ratio to a run
without is the planner's contention stretch (bench/plan_validate.py --contended).

Rows use engine_gpu's case names ('prefill N', 'decode b=B ctx=C', 'mixed b=B ctx=C n=N') with
`eager_ms`, so `splitserve plan --calibration` reads this file too. JSON to
bench/results/engine_costs-<stamp>.json.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

import torch

from bench.common import print_table, write_result
from engine.config import DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)


def _prompt(rng: random.Random, n: int, vocab: int = 40000) -> list[int]:
    # fresh random tokens: no prefix-cache hits between timed requests
    return [rng.randrange(min(100, vocab // 4), min(vocab, 40000)) for _ in range(n)]


def _timed_step(eng: Engine) -> float:
    t0 = time.perf_counter()
    eng.step()
    return (time.perf_counter() - t0) * 1e3


def _drain(eng: Engine, ids: list[str]) -> None:
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()


def _decoding(eng: Engine, rng: random.Random, tag: str, batch: int, ctx: int) -> list[str]:
    """`batch` requests prefilled to `ctx` tokens and decoding (not timed)."""
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, _prompt(rng, ctx, eng.arch.vocab_size), PARAMS)
    while any(not eng.requests[r].output_token_ids for r in ids):
        eng.step()
    eng.step()  # the first all-decode step: warm
    return ids


def prefill_ms(eng: Engine, rng: random.Random, n: int, tag: str) -> float:
    eng.add_request(tag, _prompt(rng, n, eng.arch.vocab_size), PARAMS)
    ms = _timed_step(eng)
    _drain(eng, [tag])
    return ms


def decode_ms(eng: Engine, rng: random.Random, batch: int, ctx: int, tag: str, steps: int = 5) -> float:
    ids = _decoding(eng, rng, tag, batch, ctx)
    ms = statistics.median(_timed_step(eng) for _ in range(steps))
    _drain(eng, ids)
    return ms


def mixed_ms(eng: Engine, rng: random.Random, batch: int, ctx: int, n: int, tag: str) -> float:
    ids = _decoding(eng, rng, tag, batch, ctx)
    eng.add_request(f"{tag}-p", _prompt(rng, n, eng.arch.vocab_size), PARAMS)
    ms = _timed_step(eng)
    _drain(eng, ids + [f"{tag}-p"])
    return ms


def _engine(a) -> Engine:
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    return Engine(EngineConfig(model=ModelConfig(a.model, dtype=a.dtype),
                               scheduler=SchedulerConfig(max_num_seqs=256),
                               device=DeviceConfig(device=a.device), **a.engine_extra))


def cpu_decode_attention(eng: Engine) -> str | None:
    """The decode rows' attention on CPU: 'native' (the C kernel reads each row's own context;
    engine/layers/attention_cpu_native.py) or 'torch' (contexts gathered into a copy padded to
    the longest); None off CPU. The planner's padded_attention follows it (bench/plan_validate.py)."""
    d = eng.cfg.device
    if d.device != "cpu":
        return None
    from engine import cpu_native

    native = (d.cpu_kernels != "torch" and eng.cfg.model.dtype in ("auto", "fp32", "float32")  # its q is fp32
              and cpu_native.library(d.cpu_kernels) is not None)
    return "native" if native else "torch"


def _busy(a, ready, stop) -> None:
    """A contending engine: decode `contend_batch` rows back to back until `stop` is set."""
    eng = _engine(a)
    rng = random.Random(1)
    ids = _decoding(eng, rng, "bg", a.contend_batch, a.contend_ctx)
    ready.set()
    while not stop.is_set():
        eng.step()
        if not eng.has_unfinished():  # never expected (max_tokens is huge): keep it busy anyway
            ids = _decoding(eng, rng, f"bg{random.random()}", a.contend_batch, a.contend_ctx)
    _drain(eng, ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_costs")
    ap.add_argument("--model", default="default", help="engine model (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (as `up` colocated gives decode)")
    ap.add_argument("--shape", default="smollm2-135m", help="the shape name the rows carry")
    ap.add_argument("--prefill", default="16,32,64,128,256,512")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--contexts", default="32,256")
    ap.add_argument("--mixed", default="8x64+128,16x128+64", help="BxCTX+N,...")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--contend", type=int, default=0, help="other engine processes busy on the device")
    ap.add_argument("--contend-batch", type=int, default=8)
    ap.add_argument("--contend-ctx", type=int, default=128)
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="each engine's KV budget "
                    "(on one GPU several engines must fit)")
    a = ap.parse_args(argv)
    if a.contend < 0:
        ap.error("--contend must be >= 0")
    a.engine_extra = {}
    if a.kv_cache_bytes:
        from engine.config import CacheConfig
        a.engine_extra["cache"] = CacheConfig(kv_cache_bytes=a.kv_cache_bytes)
    eng = _engine(a)
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    stop, others = ctx.Event(), []
    for _ in range(a.contend):
        ready = ctx.Event()
        others.append(ctx.Process(target=_busy, args=(a, ready, stop), daemon=True))
        others[-1].start()
        if not ready.wait(600):
            raise SystemExit("a contending engine did not start within 600 s")
    try:
        rows = _measure(a, eng)
    finally:
        stop.set()
        for p in others:
            p.join(60)
    print_table(rows, ["case", "eager_ms"])
    conf = {k: v for k, v in vars(a).items() if k != "engine_extra"}
    conf["cpu_decode_attention"] = cpu_decode_attention(eng)
    print("wrote", write_result("engine_costs", conf, {"rows": rows}))
    return 0


def _measure(a, eng: Engine) -> list[dict]:
    rng = random.Random(0)
    prefill_ms(eng, rng, 64, "warm")
    rows, k = [], 0

    def add(case: str, fn, *args):
        nonlocal k
        times = []
        for _ in range(a.reps):
            k += 1
            times.append(fn(eng, rng, *args, f"r{k}"))
        rows.append({"shape": a.shape, "case": case, "eager_ms": round(statistics.median(times), 3),
                     "runs_ms": [round(x, 3) for x in times]})
        print(f"{case}: {rows[-1]['eager_ms']} ms", flush=True)

    for n in (int(x) for x in a.prefill.split(",")):
        add(f"prefill {n}", prefill_ms, n)
    for c in (int(x) for x in a.contexts.split(",")):
        for b in (int(x) for x in a.batches.split(",")):
            add(f"decode b={b} ctx={c}", decode_ms, b, c)
    for spec in filter(None, a.mixed.split(",")):
        bc, _, n = spec.partition("+")
        b, _, c = bc.partition("x")
        add(f"mixed b={b} ctx={c} n={n}", mixed_ms, int(b), int(c), int(n))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
