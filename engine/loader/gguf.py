"""GGUF file loader: metadata -> ModelArch, tensors dequantized (gguf.quants) to the compute
dtype and renamed to HF names, tokenizer from tokenizer.ggml.*.

NOTE: llama.cpp's converter permutes the rows of attn_q / attn_k of *llama* models (HF's
rotate_half layout -> interleaved pairs). We undo it here, exactly as transformers'
GGUF loader does; qwen2 files are not permuted.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Iterator

import numpy as np
import torch

from engine.loader.errors import ModelLoadError
from engine.models.arch import ModelArch

log = logging.getLogger("splitserve.engine.loader")
LOG_EVERY = 50

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name; None for tensors the model does not use."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if m and m.group(2) in _BLK:
        return f"model.layers.{m.group(1)}.{_BLK[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute: rows [n_head, 2, d/2] interleaved -> [n_head, d/2, 2]...
    i.e. reshape(n_head, d/2, 2, ...) then swap the two middle axes (transformers' recipe)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _open(path: str):
    from engine.loader.gguf_fast import GGUFFile  # gguf.GGUFReader's interface, ~20x faster

    try:
        return GGUFFile(path)
    except Exception as e:  # bad magic, truncated file, bad offsets: all corrupt to us
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from None


def read_metadata(reader) -> dict:
    md = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            md[k] = f.contents()
        except Exception as e:
            raise ModelLoadError(f"GGUF metadata field {k!r} is unreadable: {e}") from None
    return md


def _rope_factors(reader, path: str) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            from gguf.quants import dequantize

            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
    return None


def iter_gguf_weights(reader, arch: ModelArch, device: str, dtype: torch.dtype,
                      path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    permute = arch.arch == "llama" or arch.arch == "mistral"
    tensors = [t for t in reader.tensors if hf_name(t.name) is not None]
    for k, t in enumerate(tensors, 1):
        name = hf_name(t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}): {e}") from None
        if permute and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, arch.num_heads)
        elif permute and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, arch.num_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, order="C")  # F32 tensors come back as read-only views of the mmap
        yield name, torch.from_numpy(w).to(device=device, dtype=dtype)
        if k % LOG_EVERY == 0 or k == len(tensors):
            log.info("loading gguf: %d/%d tensors", k, len(tensors))


def load_gguf(path: str, device: str, dtype: torch.dtype):
    """-> (arch, weights iterator, tokenizer or None)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    reader = _open(path)
    md = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    try:
        arch = ModelArch.from_gguf_metadata(md, has_output_tensor="output.weight" in names,
                                            vocab_size=int(emb.shape[1]))
        factors = _rope_factors(reader, path)
        if factors is not None:
            # Llama 3.x files store per-frequency divisors instead of rope scaling metadata
            from dataclasses import replace

            arch = replace(arch, rope_scaling={"rope_type": "factors",
                                               "factors": tuple(float(x) for x in factors)})
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    tok = None
    try:
        from engine.loader.gguf_tokenizer import tokenizer_from_gguf

        tok = tokenizer_from_gguf(md)
    except (ValueError, KeyError) as e:
        log.warning("%s: no tokenizer (%s): serving token ids only", path, e)
    log.info("gguf %s: %s, %d layers, %d tensors", path, arch.arch, arch.num_layers, len(reader.tensors))
    return arch, iter_gguf_weights(reader, arch, device, dtype, path), tok
