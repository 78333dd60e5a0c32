"""`splitserve tokenizer export [DIR] [--model M]`: the served model's tokenizer as a HF tokenizer
directory (tokenizer.json, tokenizer_config.json with the chat template, special tokens), for
load generators and other tools that count tokens with transformers' AutoTokenizer.

DIR defaults to ./<served model name>: a tool started in this directory and given the served
name as its model then finds the tokenizer there (transformers looks for a local directory of
that name first); elsewhere pass DIR as the tool's tokenizer.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tokenizer_cmd", required=True)
    e = sub.add_parser("export", help="write the served model's tokenizer as a HF tokenizer directory")
    e.add_argument("dir", nargs="?", default=None,
                   help="output directory (default: ./<served model name>)")
    e.add_argument("--model", default=os.environ.get("SPLITSERVE_MODEL", "default"),
                   help="same model spec as `splitserve up` ('default', a HF dir, a .gguf file, "
                        "dummy:<shape>)")
    e.add_argument("--served-model-name", default=None,
                   help="the name `up` serves it as, when set there (names the default DIR)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="context length written as model_max_length (default: the model's)")


def load_tokenizer(model: str):
    """-> (engine Tokenizer or None, the model's own name, its context length); no weights read."""
    import torch

    from engine.config import ModelConfig
    from engine.loader import load_model

    lm = load_model(ModelConfig(model=model), "cpu", torch.float32)
    close = getattr(lm.weights, "close", None)
    if close is not None:
        close()  # NOTE: the weights iterator is lazy; closing it never reads a tensor
    return lm.tokenizer, lm.name, lm.arch.max_position_embeddings


def run(a: argparse.Namespace) -> int:
    from engine.loader import ModelLoadError

    try:
        tok, name, ctx = load_tokenizer(a.model)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"splitserve tokenizer export: {e}", file=sys.stderr)
        return 2
    if tok is None:
        print(f"splitserve tokenizer export: model {a.model!r} has no tokenizer", file=sys.stderr)
        return 2
    served = a.served_model_name or name
    out = a.dir or os.path.join(".", served)
    try:
        files = tok.save_hf_dir(out, model_max_length=a.max_model_len or ctx)
    except OSError as e:
        print(f"splitserve tokenizer export: cannot write {out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote the tokenizer of {served} to {out}/ ({', '.join(files)})\n"
          f"  transformers: AutoTokenizer.from_pretrained({out!r})\n"
          f"  load generators: model {served}, tokenizer {out}", flush=True)
    return 0
