"""The CPU decode step, A/B in one process: engine variants built side by side, each step of B
decode rows timed through Engine.step (scheduling, forward, sampling, detokenizing), the variants
interleaved round by round so a shared machine's load falls on both alike.

    python -m bench.cpu_step [--batches 1,8,32] [--threads 1,2] [--rounds 5] [--steps 8]
        [--variant NAME:KEY=VALUE,...]   (DeviceConfig fields, e.g. cpu_compile=on; default: eager
                                          vs this build's defaults)

Per (threads, B, variant): the median step ms over rounds (each round: the median of --steps
steps, after B prompts of --prompt-len tokens are prefilled and a warm-up step). SmolLM2-135M
(the embedded GGUF), fp32. JSON to bench/results/cpu_step-<stamp>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from bench.common import print_table, write_result
from engine.config import DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, kv = spec.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(DeviceConfig)}
    out = {}
    for item in filter(None, kv.split(",")):
        k, _, v = item.partition("=")
        if k not in fields:
            raise SystemExit(f"--variant {spec!r}: DeviceConfig has no field {k!r}")
        out[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return name, out


def build(device_kw: dict, max_seqs: int) -> Engine:
    return Engine(EngineConfig(model=ModelConfig("default", dtype="fp32"),
                               scheduler=SchedulerConfig(max_num_seqs=max_seqs),
                               device=DeviceConfig(device="cpu", **device_kw)))


def step_ms(eng: Engine, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Median ms of a decode step of `batch` rows (prompts prefilled first, not timed)."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    ids = [f"s{seed}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
    while any(not eng.requests[r].output_token_ids for r in ids):
        eng.step()
    eng.step()  # warm-up: the first all-decode step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_step")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=39)
    ap.add_argument("--variant", action="append", default=[])
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    variants = [parse_variant(v) for v in a.variant] or [("plain", {"cpu_packed_matmul": "off"}),
                                                         ("default", {})]
    engines = {}
    for name, kw in variants:
        t0 = time.perf_counter()
        engines[name] = build(kw, max(batches))
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    res: dict[str, list[float]] = {}
    seed = 0
    for t in threads:
        torch.set_num_threads(t)
        for b in batches:
            for _ in range(a.rounds):
                for name, eng in engines.items():
                    seed += 1
                    res.setdefault(f"{t}/{b}/{name}", []).append(step_ms(eng, b, a.prompt_len,
                                                                         a.steps, seed))
    rows = []
    for t in threads:
        for b in batches:
            row = {"threads": t, "B": b}
            base = None
            for name, _ in variants:
                m = statistics.median(res[f"{t}/{b}/{name}"])
                row[f"{name} ms"] = round(m, 2)
                if base is None:
                    base = m
                else:
                    row[f"{name} / {variants[0][0]}"] = f"{m / base:.3f}"
            rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print_table(rows, cols)
    print("wrote", write_result("cpu_step", {"batches": batches, "threads": threads,
                                             "rounds": a.rounds, "steps": a.steps,
                                             "prompt_len": a.prompt_len,
                                             "variants": dict(variants)},
                                {"rows": rows, "samples_ms": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
