"""CPU paged attention, torch ops vs the C kernel (engine/layers/attention_cpu_native.py), one
process, interleaved: decode batches at several context lengths, and fresh prompts (one long
prompt, or many short ones as a burst of arrivals brings) with the C kernel's prompt rows on
and off (NATIVE_PROMPT_MAX_CTX). Between calls a buffer larger than the last-level cache is
read, so K/V come from memory as they do inside a step (the weights of 30 layers pass through
the caches between two uses of a layer's K/V).

    python -m bench.cpu_attention [--threads 2] [--rounds 5] [--heads 9,3,64]

Per case: the median microseconds of one layer's attention (plan built once, as a step does).
JSON to bench/results/cpu_attention-<stamp>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import print_table, write_result
from engine.layers import attention_cpu as ac
from engine.layers.attention_cpu_native import make
from tests.conftest import make_meta  # the metadata builder the attention tests use

FLUSH = torch.empty(64 << 20, dtype=torch.uint8)


def case(seqs_spec, hq, hkv, d, bs=16, seed=0):
    """seqs_spec: [(context before, new tokens)] -> q, k, v, cache, meta (shuffled blocks)."""
    g = torch.Generator().manual_seed(seed)
    nblk = sum(-(-(a + b) // bs) for a, b in seqs_spec) + 1
    order = (torch.randperm(nblk - 1, generator=g) + 1).tolist()
    seqs, at = [], 0
    for a, b in seqs_spec:
        k = -(-(a + b) // bs)
        seqs.append((order[at:at + k], a, b))
        at += k
    _, meta = make_meta(seqs, bs)
    t = int(meta.query_start_loc_cpu[-1])
    cache = torch.randn((2, nblk, bs, hkv, d), generator=g)
    return (torch.randn((t, hq, d), generator=g), torch.randn((t, hkv, d), generator=g),
            torch.randn((t, hkv, d), generator=g), cache, meta)


def time_us(fn, rounds: int, flush: bool) -> float:
    fn()
    out = []
    for _ in range(rounds):
        if flush:
            FLUSH.sum(dtype=torch.int64)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_attention")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--heads", default="9,3,64", help="Hq,Hkv,D (default SmolLM2-135M)")
    ap.add_argument("--no-flush", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    native = make("native")
    cases = {"decode 1 x 100": [(99, 1)], "decode 8 x 100": [(99, 1)] * 8,
             "decode 32 x 100": [(99, 1)] * 32, "decode 32 x 500": [(499, 1)] * 32,
             "decode 8 x 2000": [(1999, 1)] * 8,
             "prompts 32 x 39": [(0, 39)] * 32, "prompts 8 x 128": [(0, 128)] * 8,
             "prompt 1 x 256": [(0, 256)], "prompt 1 x 512": [(0, 512)], "prompt 1 x 1024": [(0, 1024)],
             "chunk 256 after 256": [(256, 256)]}
    rows = []
    saved = ac.NATIVE_PROMPT_MAX_CTX
    try:
        for name, spec in cases.items():
            q, k, v, cache, meta = case(spec, hq, hkv, d)
            scale = d ** -0.5
            res = {}
            for label, nd, limit in (("torch", None, saved), ("native", native, 1 << 30),
                                     ("native, prompts torch", native, 0)):
                if label == "native, prompts torch" and not name.startswith(("prompt", "chunk")):
                    continue
                ac.NATIVE_PROMPT_MAX_CTX = limit
                plan = ac.build_plan(meta, hq, hkv, torch.float32, q.device, nd)
                res[label] = time_us(lambda: ac.paged_attention_cpu(q, k, v, cache, meta, scale, plan),
                                     a.rounds, not a.no_flush)
            row = {"case": name, **{f"{k} us": round(v) for k, v in res.items()},
                   "torch / native": f"{res['torch'] / res['native']:.2f}"}
            rows.append(row)
            print(row, flush=True)
    finally:
        ac.NATIVE_PROMPT_MAX_CTX = saved
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    print("wrote", write_result("cpu_attention", {"threads": a.threads, "heads": [hq, hkv, d],
                                                  "rounds": a.rounds, "flush": not a.no_flush},
                                {"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
