"""Attention backends side by side on one GPU: FlashAttention (FA4, `--attention-backend
flash_attn`) vs our Triton kernels, at Llama-3.1-8B attention shapes (32 q / 8 kv heads, d 128,
bf16, paged KV):
1. varlen prefill attention TFLOP/s (causal; 8 x 2048 and 1 x 4096 tokens),
2. paged decode attention TB/s of KV read (batch 32 and 64, context 4096), eager and CUDA-graph replay,
3. whole 8B prefill steps (random weights) at 512 / 2048 / 4096 tokens with each backend,
each with its error against the torch reference. Prints a table; JSON to bench/results/.

    python bench/attention_backends_gpu.py [--block-size 16] [--no-model] [--commit SHA]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import print_table, write_result  # noqa: E402
from bench.engine_gpu_steps import make_engine, time_prefill  # noqa: E402
from bench.timing import cuda_time_ms, graph_time_ms  # noqa: E402
from engine.kernels.reference import paged_attention_torch  # noqa: E402
from engine.layers.attention_select import get_attention_backend  # noqa: E402
from tests.engine.kernels._util import make_batch, rel_err  # noqa: E402

HQ, HKV, D = 32, 8, 128
BACKENDS = ("triton", "flash_attn")


def _backend(name: str):
    try:
        return get_attention_backend(name, "cuda", HQ, HKV, D), None
    except Exception as e:  # a backend that cannot load is a row with its error
        return None, f"{type(e).__name__}: {e}"[:200]


def _kernel_row(case: str, name: str, seq_lens, q_lens, bs: int, work: float, unit: str) -> dict:
    be, err = _backend(name)
    row = {"case": case, "backend": name}
    if be is None:
        return {**row, "error": err}
    kv, meta = make_batch(seq_lens, q_lens, bs, HKV, D, torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, D, generator=g).to("cuda", torch.bfloat16)
               for h in (HQ, HKV, HKV))
    try:
        out = be.forward(0, q, k, v, kv, meta)
        sub = slice(0, min(T, 4096))  # the reference loops on the host: check a slice of rows
        ref = paged_attention_torch(q.float(), kv, meta, D ** -0.5)
        row["rel_err"] = round(rel_err(out[sub], ref[sub]), 5)
        fn = lambda: be.forward(0, q, k, v, kv, meta)  # noqa: E731
        ms = cuda_time_ms(fn, iters=30, warmup=5)
        row.update(ms=round(ms, 4), **{unit: round(work / ms / 1e9, 2 if unit == "TB/s" else 1)})
        if unit == "TB/s":
            meta.seq_lens_cpu = meta.query_start_loc_cpu = None  # graph-safe metadata only
            try:
                gms = graph_time_ms([fn])
                row.update(graph_ms=round(gms, 4), **{"TB/s_graph": round(work / gms / 1e9, 2)})
            except Exception as e:
                row["graph_error"] = f"{type(e).__name__}: {e}"[:160]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def kernel_rows(bs: int) -> list[dict]:
    rows = []
    for nseq, L in ((8, 2048), (1, 4096)):
        flops = nseq * 4 * HQ * D * (L * (L + 1) // 2)  # QK^T + PV over the causal triangle
        for name in BACKENDS:
            rows.append(_kernel_row(f"prefill {nseq}x{L}", name, [L] * nseq, [L] * nseq, bs,
                                    flops, "TFLOP/s"))
    for batch in (32, 64):
        ctx = 4096
        kv_bytes = batch * ctx * HKV * D * 2 * 2  # K and V, bf16
        for name in BACKENDS:
            rows.append(_kernel_row(f"decode {batch}x{ctx}", name, [ctx] * batch, [1] * batch,
                                    bs, kv_bytes, "TB/s"))
    return rows


def model_rows(lens=(512, 2048, 4096)) -> list[dict]:
    rows = []
    for name in BACKENDS:
        try:
            eng = make_engine("llama-3.1-8b", max_batch=8, max_ctx=max(lens), eager=True,
                              backend=name, prefill_graphs=False)
        except Exception as e:
            rows.append({"case": "8B prefill", "backend": name, "error": f"{e}"[:200]})
            continue
        for n in lens:
            rows.append({"case": f"8B prefill {n}", "backend": name,
                         "ms": round(time_prefill(eng, n), 3)})
        del eng
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-model", action="store_true", help="kernels only")
    args = ap.parse_args()
    rows = kernel_rows(args.block_size)
    if not args.no_model:
        rows += model_rows()
    cols = ["case", "backend", "ms", "TFLOP/s", "TB/s", "graph_ms", "TB/s_graph", "rel_err", "error"]
    print_table(rows, cols)
    path = write_result("attention_backends_gpu", {"block_size": args.block_size,
                                                   "gpu": torch.cuda.get_device_name()},
                        {"rows": rows})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
