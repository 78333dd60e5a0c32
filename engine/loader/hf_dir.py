"""HF checkpoint directory: config.json + *.safetensors (sharded via
model.safetensors.index.json, or not) + tokenizer.json (+ tokenizer_config.json).

Every shard's header is checked up front (a truncated or corrupt file fails in load_model,
not halfway through load_weights); tensors are then streamed lazily, one at a time,
converted to the target device and dtype.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import torch
from safetensors import safe_open

from engine.loader.errors import ModelLoadError
from engine.models.arch import ModelArch

log = logging.getLogger("splitserve.engine.loader")
LOG_EVERY = 50  # progress line every N tensors


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"model directory {path!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: cannot parse config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: config.json is not a JSON object")
    return cfg


def _merge_generation_eos(path: str, arch: ModelArch) -> ModelArch:
    """generation_config.json may list more eos ids than config.json (Llama 3 instruct)."""
    gpath = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gpath):
        return arch
    try:
        with open(gpath, encoding="utf-8") as f:
            g = json.load(f)
    except (OSError, json.JSONDecodeError):
        log.warning("ignoring unreadable %s", gpath)
        return arch
    eos = g.get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    merged = tuple(dict.fromkeys(list(arch.eos_token_ids) + [int(e) for e in extra]))
    from dataclasses import replace

    return replace(arch, eos_token_ids=merged)


def shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable safetensors index: {e}") from None
        files = sorted(set(wm.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {path!r} has no *.safetensors files")
    out = []
    for f in files:
        full = os.path.join(path, f)
        if not os.path.isfile(full):
            raise ModelLoadError(f"safetensors shard {full!r} is listed in the index but missing")
        out.append(full)
    return out


def check_shard(file: str) -> int:
    """Opens the header and checks that every tensor's bytes lie inside the file.
    Returns the tensor count. Raises ModelLoadError on a corrupt/truncated file."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{file}: corrupt safetensors file (shorter than its header)")
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                raise ModelLoadError(f"{file}: corrupt safetensors file (header length {n} > file size {size})")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{file}: corrupt safetensors header: {e}") from None
    data_len = size - 8 - n
    count = 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        end = v.get("data_offsets", [0, 0])[1]
        if end > data_len:
            raise ModelLoadError(f"{file}: truncated safetensors file: tensor {k!r} ends at byte "
                                 f"{end} but only {data_len} data bytes exist")
        count += 1
    return count


def iter_weights(files: list[str], device: str, dtype: torch.dtype,
                 total: int) -> Iterator[tuple[str, torch.Tensor]]:
    done = 0
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    # integer tensors (none in these archs) would keep their dtype
                    yield name, t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                    done += 1
                    if done % LOG_EVERY == 0 or done == total:
                        log.info("loading weights: %d/%d tensors", done, total)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{file}: cannot read safetensors: {e}") from None


def load_hf_dir(path: str, device: str, dtype: torch.dtype):
    """-> (arch, weights iterator, tokenizer or None)."""
    cfg = read_config(path)
    try:
        arch = ModelArch.from_hf_config(cfg)
    except ValueError as e:
        raise ModelLoadError(f"{os.path.join(path, 'config.json')}: {e}") from None
    arch = _merge_generation_eos(path, arch)
    sw = cfg.get("sliding_window")
    if sw and cfg.get("use_sliding_window", True) and int(sw) < arch.max_position_embeddings:
        # NOTE: attention here is always full; beyond `sliding_window` tokens outputs differ
        log.warning("%s: sliding_window=%s is ignored (full attention); contexts longer than "
                    "that differ from the reference model", path, sw)
    files = shard_files(path)
    total = sum(check_shard(f) for f in files)
    log.info("hf checkpoint %s: %s, %d layers, %d shards, %d tensors", path, arch.arch,
             arch.num_layers, len(files), total)
    tok = None
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from engine.tokenizer import Tokenizer

        try:
            tok = Tokenizer.from_hf_dir(path, eos_token_ids=arch.eos_token_ids, bos_token_id=arch.bos_token_id)
        except Exception as e:  # tokenizers raises its own Exception type on a bad file
            raise ModelLoadError(f"{path}: cannot load tokenizer.json / tokenizer_config.json: {e}") from None
    else:
        log.warning("%s has no tokenizer.json: serving token ids only", path)
    return arch, iter_weights(files, device, dtype, total), tok
