"""Offline entry point for debugging: `python -m engine.generate --model default --prompt "Hi"`.

Runs the engine in-process (no services), streams text as it is produced, and prints timing.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.config import (ASYNC_SCHEDULING, CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                           SchedulerConfig)
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def build_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=a.seed),
        cache=CacheConfig(block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  async_scheduling=ASYNC_SCHEDULING[a.async_scheduling]),
        device=DeviceConfig(device=a.device, enforce_eager=a.enforce_eager,
                            attention_backend=a.attention_backend, cpu_threads=a.cpu_threads,
                            cuda_graph_max_batch=a.cuda_graph_max_batch,
                            cuda_graph_max_prefill_tokens=a.cuda_graph_max_prefill_tokens,
                            skinny_gemm_max_batch=a.skinny_gemm_max_batch),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", choices=tuple(ASYNC_SCHEDULING), default="auto",
                   help="overlapped decode (engine/overlap.py); auto: on for CUDA")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="largest decode batch replayed through a CUDA graph")
    p.add_argument("--cuda-graph-max-prefill-tokens", type=int, default=2048,
                   help="largest prefill step (tokens) replayed through a CUDA graph; 0 disables")
    p.add_argument("--skinny-gemm-max-batch", type=int, default=None,
                   help="decode batches up to this size use the fused skinny-GEMM kernels "
                        "(default: the GPU's tuned table; 0 disables)")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    eng = Engine(build_config(a))
    tok = eng.tokenizer
    if tok is None:
        print("this model has no tokenizer", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed)
    detoks = {}
    for i, prompt in enumerate(a.prompt):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if a.chat else prompt
        ids = tok.encode(text, add_special_tokens=not a.chat)
        eng.add_request(str(i), ids, params)
        detoks[str(i)] = tok.detokenizer(ids, params)
    texts = {k: "" for k in detoks}
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        for out in eng.step():
            n += len(out.new_token_ids)
            delta, _ = detoks[out.request_id].step(out.new_token_ids)
            if out.finished:
                delta += detoks[out.request_id].flush()
            texts[out.request_id] += delta
            if len(a.prompt) == 1:
                print(delta, end="", flush=True)
    dt = time.perf_counter() - t0
    if len(a.prompt) > 1:
        for k in sorted(texts, key=int):
            print(f"[{k}] {texts[k]}")
    else:
        print()
    print(f"-- {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
