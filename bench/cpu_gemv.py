"""One-row CPU matmuls of the embedded model, per weight shape: F.linear vs oneDNN's packed
copy, streamed over the model's own weights (engine/cpu_gemv.py's choice, repeated).

    python -m bench.cpu_gemv [--threads 2] [--rounds 3]

Per shape and round: GB/s of each candidate and the one chosen. JSON to
bench/results/cpu_gemv-<stamp>.json.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import print_table, write_result
from engine import cpu_gemv
from engine.config import DeviceConfig, EngineConfig, ModelConfig
from engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    eng = Engine(EngineConfig(model=ModelConfig("default", dtype="fp32"),
                              device=DeviceConfig(device="cpu", cpu_threads=a.threads,
                                                  cpu_one_row_matmul="torch")))
    model = eng.runner.model
    rows = []
    for r in range(a.rounds):
        table, _ = cpu_gemv.setup(model, eng.runner.packed_head)
        for shape, t in table.items():
            gb = shape[0] * shape[1] * 4 / 1e9
            rows.append({"round": r, "shape": "x".join(map(str, shape)),
                         "torch_GBps": round(gb / t["torch"], 1), "packed_GBps": round(gb / t["packed"], 1),
                         "best": t["best"]})
    print(f"threads {torch.get_num_threads()}")
    print_table(rows, ["round", "shape", "torch_GBps", "packed_GBps", "best"])
    print("results:", write_result("cpu_gemv", {**vars(a), "threads": torch.get_num_threads()},
                                   {"rows": rows}))


if __name__ == "__main__":
    main()
