"""The engine thread's host work a decode step, outside the model: Engine.step() wall time
minus the model's forward (ModelRunner._eager_logits), on CPU with the tiny random Llama, ROWS
running requests, prefix caching on and overlapped decode on (the GPU default; its
scheduling, block and output bookkeeping are the GPU path's own) or off. On a GPU this host work must fit under the step's
kernels, beside the decode service's event loop (python -m lab.decode_stream_probe).

    python -m lab.engine_host_probe [--rows 64] [--steps 400] [--rounds 3] [--overlap on|off]
"""
from __future__ import annotations

import argparse
import statistics
import time


def one_round(rows: int, steps: int, overlap: bool) -> float:
    """Median host microseconds a step over `steps` steps."""
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    eng = Engine(EngineConfig(
        model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=2048),
        cache=CacheConfig(num_blocks=rows * (2048 // 16 + 1), enable_prefix_caching=True),
        device=DeviceConfig(device="cpu"), scheduler=SchedulerConfig(async_scheduling=overlap)))
    runner = eng.runner
    model_s = [0.0]
    inner = runner._eager_logits

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            model_s[0] += time.perf_counter() - t

    runner._eager_logits = timed
    params = SamplingParams(max_tokens=steps + 50, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        eng.add_request(f"r{i}", list(range(10 + i, 138 + i)), params)  # no shared prefix
    for _ in range(10):  # the prompts' prefill and the first decode steps
        eng.step()
    host = []
    for _ in range(steps):
        model_s[0] = 0.0
        t = time.perf_counter()
        eng.step()
        host.append(time.perf_counter() - t - model_s[0])
    return statistics.median(host) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.engine_host_probe")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--overlap", choices=("on", "off"), default="on")
    a = p.parse_args(argv)
    res = [one_round(a.rows, a.steps, a.overlap == "on") for _ in range(a.rounds)]
    print("host us a step: " + " / ".join(f"{x:.0f}" for x in res) +
          f"  median {statistics.median(res):.0f} ({statistics.median(res) / a.rows:.2f} a row)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
