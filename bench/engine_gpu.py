"""Engine benchmark on one GPU, one call: decode step time (CUDA graphs and eager) for several
batch sizes and contexts, prefill throughput, HF transformers eager, and the roofline.

    python -m bench.engine_gpu [--shapes llama-3.2-1b,llama-3.1-8b] [--quick] [--recaptures 2]

Random bf16 weights in the real shapes. Timings: CUDA events, warm-up, median of many.
Roofline: decode floor = (weight bytes + KV bytes read) / measured copy bandwidth;
prefill floor = FLOPs / measured bf16 GEMM rate. Kernel micro-benchmarks: bench/kernels_gpu.py.
The target cases (batch 1 at ctx 1024, batch 64 at ctx 2048) are also timed after each
of --recaptures fresh graph captures, and reported as the median over all captures: one capture
of the same step moves by up to 6% on the H200, more than most differences worth measuring.
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time

import torch

from bench.common import print_table, write_result
from bench.decode_loop import both_loops
from bench.engine_gpu_steps import (gemm_tflops, hf_decode_ms, hf_generate_ms_per_token,
                                    kv_bytes_per_token, make_engine, model_flops_per_token,
                                    time_decode, time_prefill, weight_bytes)
from bench.timing import copy_bandwidth_gbs
from engine.runner import format_ranges

DECODE_CASES = [(1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024),
                (1, 4096), (8, 4096), (32, 4096), (64, 4096), (128, 4096), (64, 2048)]
PREFILL_LENS = [128, 512, 2048, 4096]
TARGET_CASES = [(1, 1024), (64, 2048)]


def bench_shape(shape: str, bw: float, tflops: float, quick: bool, recaptures: int = 2) -> list[dict]:
    rows = []
    cases = DECODE_CASES if not quick else [(1, 1024), (64, 2048)]
    max_batch = max(b for b, _ in cases)
    max_ctx = max(c for _, c in cases)
    t0 = time.perf_counter()
    # KV for the largest case only; other cases reuse the first blocks.
    nb = max(b * (-(-(c + 1) // 16)) for b, c in cases) + 8
    eng = make_engine(shape, max_batch, max_ctx, eager=False, num_blocks=nb)
    print(f"[{shape}] engine + graphs ready in {time.perf_counter() - t0:.1f}s "
          f"({eng.runner.graphs.metrics() if eng.runner.graphs else 'no graphs'})", flush=True)
    wb = weight_bytes(eng.runner.model)
    kvt = kv_bytes_per_token(eng.arch)
    for b, c in cases:
        t = time_decode(eng, b, c)
        floor = (wb + b * c * kvt) / (bw * 1e9) * 1e3
        rows.append({"shape": shape, "case": f"decode b={b} ctx={c}",
                     "graph_ms": round(t.get("graph_ms", float("nan")), 3),
                     "replay_ms": round(t.get("replay_ms", float("nan")), 3),
                     "eager_ms": round(t["eager_ms"], 3), "floor_ms": round(floor, 3),
                     "floor/graph": round(floor / t.get("graph_ms", float("nan")), 3)})
        print("  ", rows[-1], flush=True)
    rows += _recaptured(eng, shape, [bc for bc in cases if bc in TARGET_CASES], rows, recaptures, max_ctx)
    rows += _serving_loop(eng, shape, [bc for bc in cases if bc in TARGET_CASES])
    # the same step with cuBLAS matmuls + separate norm/activation kernels (skinny path off)
    model = eng.runner.model
    saved = (model.skinny_max_m, model.skinny_rows)
    print(f"[{shape}] fused skinny-GEMM decode path for batches <= {saved[0]}"
          + (f" in {format_ranges(sorted(saved[1]))}" if saved[1] is not None else ""), flush=True)
    if max_batch >= 64:
        # fused skinny-GEMM path vs cuBLAS + separate norm/activation kernels, same graphs
        for m in (64, 0):
            model.skinny_max_m, model.skinny_rows = m, None
            eng.runner.maybe_capture_graphs(max_ctx + 64, model.attn_backend.name)
            for b in ((1, 2, 4, 8, 16, 32, 64) if not quick else (1, 64)):
                t = time_decode(eng, b, 1024, eager=False)
                rows.append({"shape": shape, "case": f"decode b={b} ctx=1024 " + ("skinny" if m else "cuBLAS"),
                             "graph_ms": round(t["graph_ms"], 3)})
                print("  ", rows[-1], flush=True)
        model.skinny_max_m, model.skinny_rows = saved
        # rotary + KV append fused into decode attention vs the separate kernel (A/B)
        be = model.attn_backend
        if hasattr(be, "fuse_decode_rope"):
            limit = be.fuse_decode_rope_max_seqs
            be.fuse_decode_rope_max_seqs = 1 << 30  # the A/B covers every batch size
            for fused in (False, True):
                be.fuse_decode_rope = fused
                eng.runner.maybe_capture_graphs(max_ctx + 64, be.name)
                for b in (1, 64):
                    t = time_decode(eng, b, 1024, eager=False)
                    rows.append({"shape": shape, "case": f"decode b={b} ctx=1024 rope " + ("fused" if fused else "separate"),
                                 "graph_ms": round(t["graph_ms"], 3)})
                    print("  ", rows[-1], flush=True)
            be.fuse_decode_rope_max_seqs = limit
    for n in (PREFILL_LENS if not quick else [512, 4096]):
        ms = time_prefill(eng, n)
        gms = time_prefill(eng, n, graphs=True)  # nan above the largest prefill graph bucket
        best = min(ms, gms) if gms == gms else ms
        flops = model_flops_per_token(eng.arch, n // 2) * n
        # floor: the larger of compute (FLOPs / GEMM rate) and weight streaming (bytes / copy rate)
        floor = max(flops / (tflops * 1e12), wb / (bw * 1e9)) * 1e3
        rows.append({"shape": shape, "case": f"prefill {n}", "eager_ms": round(ms, 3),
                     "graph_ms": round(gms, 3) if gms == gms else None,
                     "tflops": round(flops / (best * 1e-3) / 1e12, 1),
                     "floor_ms": round(floor, 3), "floor/graph": round(floor / best, 3)})
        print("  ", rows[-1], flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    # HF eager on the same shape (batch 1, ctx 1024)
    eng = make_engine(shape, 1, 1100, eager=True, num_blocks=80)
    hf = hf_decode_ms(eng, 1024)
    rows.append({"shape": shape, "case": "HF eager decode b=1 ctx=1024",
                 "eager_ms": round(hf, 3) if hf else None})
    print("  ", rows[-1], flush=True)
    hfg = hf_generate_ms_per_token(eng, 1024)
    rows.append({"shape": shape, "case": "HF generate per token b=1 ctx=1024",
                 "eager_ms": round(hfg, 3) if hfg else None})
    print("  ", rows[-1], flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _serving_loop(eng, shape: str, cases, steps: int = 48) -> list[dict]:
    """Time per decode step of the engine's serving loop (Engine.step(): scheduling,
    staging, replay, sampling, token readback, outputs) in a real greedy generation, with
    overlapped decode off (sync_ms) and on (tpot_ms, the default on CUDA): the TPOT a client
    sees, next to the graph step above; and a steady state with arrivals (bench.decode_loop's
    arrivals_loop: a request ends and a 128-token prompt arrives every 8 steps), generated
    tokens per second with the overlap off and on."""
    out = []
    for b, c in cases:
        loops = both_loops(eng, b, c, steps, tag=f"{b}x{c}-", arrivals=True)
        sync, ov = loops["sync"], loops["overlap"]
        out.append({"shape": shape, "case": f"serving loop b={b} ctx={c}",
                    "sync_ms": round(sync["engine_ms"], 3), "tpot_ms": round(ov["engine_ms"], 3),
                    "arrivals_sync_tok_s": round(sync["arr_tok_s"], 1),
                    "arrivals_tok_s": round(ov["arr_tok_s"], 1),
                    "arrivals_blind_steps": ov["arr_blind"], "arrivals_mixed_steps": ov["arr_mixed"]})
        print("  ", out[-1], flush=True)
    return out


def _recaptured(eng, shape: str, cases, rows: list[dict], recaptures: int, max_ctx: int) -> list[dict]:
    """Median graph step time of each case over the first capture (its row in `rows`) and
    `recaptures` fresh ones."""
    if not recaptures or not cases or eng.runner.graphs is None:
        return []
    first = {c: next(r for r in rows if r["shape"] == shape
                     and r["case"] == f"decode b={c[0]} ctx={c[1]}") for c in cases}
    samples = {c: [r["graph_ms"]] for c, r in first.items()}
    replays = {c: [r.get("replay_ms", float("nan"))] for c, r in first.items()}
    for _ in range(recaptures):
        eng.runner.maybe_capture_graphs(max_ctx + 64, eng.runner.model.attn_backend.name)
        for b, c in cases:
            t = time_decode(eng, b, c, eager=False)
            samples[(b, c)].append(round(t["graph_ms"], 3))
            replays[(b, c)].append(round(t.get("replay_ms", float("nan")), 3))
    out = []
    for (b, c), ms in samples.items():
        out.append({"shape": shape, "case": f"decode b={b} ctx={c} median of {len(ms)} captures",
                    "graph_ms": round(statistics.median(ms), 3), "samples": ms,
                    "replay_ms": round(statistics.median(replays[(b, c)]), 3),
                    "replay_samples": replays[(b, c)]})
        print("  ", out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--recaptures", type=int, default=2,
                    help="fresh graph captures for the target cases' medians (0: none)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth_gbs()
    tf = gemm_tflops()
    print(f"copy bandwidth {bw:.0f} GB/s, bf16 GEMM {tf:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        rows += bench_shape(shape, bw, tf, a.quick, a.recaptures)
    # ratios vs HF at batch 1
    for shape in a.shapes.split(","):
        # the median over captures where the run has it, else the one capture
        ours = next((r.get("graph_ms") for r in rows if r["shape"] == shape
                     and r["case"].startswith("decode b=1 ctx=1024 median of")), None) or next(
            (r.get("graph_ms") for r in rows if r["shape"] == shape and r["case"] == "decode b=1 ctx=1024"), None)
        # a client's time per token: the serving loop's (overlapped decode), where measured
        tpot = next((r.get("tpot_ms") for r in rows if r["shape"] == shape
                     and r["case"] == "serving loop b=1 ctx=1024"), None)
        for tag, prefix, mine in (("HF forward", "HF eager decode", ours),
                                  ("HF generate", "HF generate", tpot or ours)):
            hf = next((r["eager_ms"] for r in rows if r["shape"] == shape
                       and r["case"].startswith(prefix)), None)
            if hf and mine:
                rows.append({"shape": shape, "case": f"speedup vs {tag} b=1"
                             + (" (serving loop TPOT)" if mine is tpot else " (graph step)"),
                             "graph_ms": round(hf / mine, 1)})
    print_table(rows, ["shape", "case", "graph_ms", "replay_ms", "eager_ms", "sync_ms", "tpot_ms", "floor_ms",
                       "floor/graph", "tflops", "arrivals_sync_tok_s", "arrivals_tok_s"])
    path = write_result("engine_gpu", {"shapes": a.shapes, "dtype": "bf16", "block_size": 16,
                                       "recaptures": a.recaptures,
                                       "copy_gbs": round(bw, 1), "gemm_tflops": round(tf, 1)},
                        {"rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
