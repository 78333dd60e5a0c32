"""Host cost of overlapped decode's planning (engine/overlap.py): per step, plan_follow (may the
next step be launched blind?) and follow (build it through the scheduler's own rules), at a few
batch sizes, on a tiny engine (the model's time does not enter; any device). The GPU step they
hide under is milliseconds; this says how much of it they take.

    python -m lab.overlap_host [--batches 8,32,128] [--steps 40] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import engine.engine as engine_mod
from bench.common import print_table, write_result
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def measure(batch: int, steps: int, device: str) -> dict:
    eng = Engine(EngineConfig(
        model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=batch * 8 + 16),
        scheduler=SchedulerConfig(max_num_seqs=batch, async_scheduling=True),
        device=DeviceConfig(device=device)))
    times = {"plan": [], "follow": []}
    real = {"plan": engine_mod.plan_follow, "follow": engine_mod.follow}

    def timed(name):
        def run(*a):
            t = time.perf_counter()
            try:
                return real[name](*a)
            finally:
                times[name].append(time.perf_counter() - t)
        return run

    engine_mod.plan_follow, engine_mod.follow = timed("plan"), timed("follow")
    try:
        for i in range(batch):
            eng.add_request(f"r{i}", [1 + i % 50] * 20,
                            SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        n = 0
        while eng.has_unfinished():
            eng.step()
            n += 1
        wall = (time.perf_counter() - t) / n
    finally:
        engine_mod.plan_follow, engine_mod.follow = real["plan"], real["follow"]
    return {"batch": batch, "plan_us": round(statistics.median(times["plan"]) * 1e6, 1),
            "follow_us": round(statistics.median(times["follow"]) * 1e6, 1),
            "blind_steps": eng.num_overlapped_steps, "steps": n,
            "step_wall_ms": round(wall * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    rows = [measure(int(b), a.steps, a.device) for b in a.batches.split(",")]
    print_table(rows, ["batch", "plan_us", "follow_us", "blind_steps", "steps", "step_wall_ms"])
    write_result("overlap_host", vars(a), {"rows": rows})


if __name__ == "__main__":
    main()
