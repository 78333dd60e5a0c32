"""Is a decode graph's speed a property of its capture? Whole-step A/Bs on the H200 re-capture
per rep, and the same configuration's step times can fall in two modes ~3% apart (8B batch 1;
lab/notes/kernels.md). This captures the bucket's graph
N times in one engine (each capture keeps its own memory pool alive), then replays every
capture in R interleaved rounds: a capture that is slow in every round (and a fast one fast)
means the mode is fixed at capture; modes that move between rounds mean it is not.

    python -m lab.capture_variance [--shape llama-3.1-8b] [--batch 1] [--ctx 1024]
                                   [--captures 8] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import print_table, write_result
from bench.engine_gpu_steps import decode_inputs, make_engine, rows_of
from bench.timing import cuda_time_ms


@torch.inference_mode()
def run(shape: str, batch: int, ctx: int, captures: int, rounds: int) -> list[dict]:
    eng = make_engine(shape, batch, ctx + 1, eager=False, prefill_graphs=False)
    ids, _, meta = decode_inputs(eng, batch, ctx)
    rows = rows_of(ids, meta, ctx)
    kept = []
    for i in range(captures):
        if i:
            eng.runner.maybe_capture_graphs(eng.max_model_len, eng.runner.model.attn_backend.name)
        g = eng.runner.graphs
        kept.append(g)  # holds this capture's pool: the next capture gets fresh memory
        print(f"capture {i + 1}/{captures}", flush=True)
    times = [[] for _ in kept]
    for r in range(rounds):
        for i, g in enumerate(kept):
            b = g.bucket_for(batch)
            g.staging.stage(rows, g.block_size, b, b)
            g.staging.upload(b)
            for _ in range(20):
                g.graphs[b].replay()
            times[i].append(cuda_time_ms(g.graphs[b].replay, iters=50))
        print(f"round {r + 1}/{rounds}", flush=True)
    out = []
    for i, (g, ts) in enumerate(zip(kept, times)):
        b = g.bucket_for(batch)
        out.append({"case": f"{shape} b={batch} ctx={ctx}", "capture": i,
                    "replay_ms": [round(t, 4) for t in ts], "median_ms": round(statistics.median(ts), 4),
                    "spread": round(max(ts) / min(ts) - 1, 4),
                    "out_ptr_mod_2m": g.outputs[b].data_ptr() % (2 << 20)})
    meds = [r["median_ms"] for r in out]
    out.append({"case": "between captures", "capture": "max/min",
                "median_ms": round(max(meds) / min(meds) - 1, 4),
                "spread": round(statistics.median(r["spread"] for r in out), 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--captures", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows = run(a.shape, a.batch, a.ctx, a.captures, a.rounds)
    print_table(rows, ["case", "capture", "replay_ms", "median_ms", "spread", "out_ptr_mod_2m"])
    write_result("capture_variance", vars(a), {"rows": rows})


if __name__ == "__main__":
    main()
