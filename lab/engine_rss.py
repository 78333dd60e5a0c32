"""Does the bare engine's RSS grow over many requests (SmolLM2, CPU, 1 thread)?

    python -m lab.engine_rss [ROUNDS] [--fixed]

Each round adds 1-4 requests of 16-128 prompt tokens (--fixed: one of 64), 16 tokens out, and
steps until they finish; RSS every 10 rounds. lab/notes/soak_rss.md has the results.
"""
import random
import sys
import time

import psutil
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)
cfg = EngineConfig(model=ModelConfig(model="default", dtype="fp32"),
                   cache=CacheConfig(enable_prefix_caching=False, num_blocks=1456),
                   device=DeviceConfig(device="cpu", enforce_eager=True, cpu_threads=1))
eng = Engine(cfg)
rng = random.Random(0)
fixed = "--fixed" in sys.argv
args = [a for a in sys.argv[1:] if a != "--fixed"]
p = psutil.Process()
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
t0, i = time.time(), 0
for rnd in range(int(args[0]) if args else 60):
    for _ in range(1 if fixed else rng.randint(1, 4)):
        n = 64 if fixed else rng.randint(16, 128)
        eng.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(n)], params)
        i += 1
    while eng.has_unfinished():
        eng.step()
    if rnd % 10 == 0:
        print(f"{time.time()-t0:6.1f}s req {i:4d} rss {p.memory_info().rss/2**20:8.1f} MiB", flush=True)
