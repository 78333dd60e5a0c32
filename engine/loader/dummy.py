"""dummy:<shape>: random weights of a named shape, generated directly on the target device
in the target dtype (seeded, std 0.02; norms = 1), for benchmarks and tests without files."""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from engine.loader.errors import ModelLoadError
from engine.models.arch import ModelArch

log = logging.getLogger("splitserve.engine.loader")
LOG_EVERY = 64
STD = 0.02

_L3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}

SHAPES: dict[str, ModelArch] = {
    "llama-3.1-8b": ModelArch(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_L3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "llama-3.2-1b": ModelArch(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_L3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "smollm2-135m": ModelArch(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=1, eos_token_ids=(2,)),
    "tiny-llama": ModelArch(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=256, eos_token_ids=(257,)),
    "tiny-qwen2": ModelArch(
        arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=256, eos_token_ids=(257,)),
}


def weight_shapes(a: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of a checkpoint of this arch, in checkpoint order."""
    h, i = a.hidden_size, a.intermediate_size
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (a.vocab_size, h))]
    for n in range(a.num_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (a.q_size, h)),
                (p + "self_attn.k_proj.weight", (a.kv_size, h)),
                (p + "self_attn.v_proj.weight", (a.kv_size, h))]
        if a.attention_bias:
            out += [(p + "self_attn.q_proj.bias", (a.q_size,)),
                    (p + "self_attn.k_proj.bias", (a.kv_size,)),
                    (p + "self_attn.v_proj.bias", (a.kv_size,))]
        out += [(p + "self_attn.o_proj.weight", (h, a.q_size))]
        if a.o_proj_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        out += [(p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not a.tie_word_embeddings:
        out.append(("lm_head.weight", (a.vocab_size, h)))
    return out


def get_shape(shape: str) -> ModelArch:
    if shape not in SHAPES:
        raise ModelLoadError(f"unknown dummy shape {shape!r}; choose one of {sorted(SHAPES)}")
    return SHAPES[shape]


def iter_dummy_weights(a: ModelArch, device: str, dtype: torch.dtype,
                       seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shapes = weight_shapes(a)
    for k, (name, shape) in enumerate(shapes, 1):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = torch.ones(shape, device=device, dtype=dtype)
        else:
            t = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, STD, generator=gen)
        yield name, t
        if k % LOG_EVERY == 0 or k == len(shapes):
            log.info("dummy weights: %d/%d tensors", k, len(shapes))


def load_dummy(shape: str, device: str, dtype: torch.dtype, seed: int = 0):
    """-> (arch, weights iterator, byte-level tokenizer)."""
    a = get_shape(shape)
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.byte_level(a.vocab_size, bos_token_id=a.bos_token_id, eos_token_ids=a.eos_token_ids)
    log.info("dummy model %s: %.2fB params, random weights (seed %d)", shape, a.num_params() / 1e9, seed)
    return a, iter_dummy_weights(a, device, dtype, seed), tok
