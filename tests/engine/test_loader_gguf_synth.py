"""GGUF files written here from tiny HF checkpoints the way llama.cpp's converter writes them
(q/k rows permuted for llama, Llama-3 rope as a rope_freqs tensor, qwen2 unpermuted with
biases, Q8_0 weights) load through our GGUF loader and reproduce HF's logits. Independent of
transformers' own GGUF reader."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_model
from tests.conftest import build_model, make_kv, make_meta

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

_BLK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:  # llama.cpp LlamaModel.generate_extra_tensors
    rp = cfg.rope_parameters
    base, dim = rp["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(1.0)
        elif wl > old / lo:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf, path: str, qtype=None) -> None:
    cfg = hf.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<mod...>.<weight|bias>
            g = f"blk.{parts[2]}.{_BLK['.'.join(parts[3:-1])]}.{parts[-1]}"
            if arch == "llama" and g.endswith("attn_q.weight"):
                a = _permute(a, cfg.num_attention_heads)
            elif arch == "llama" and g.endswith("attn_k.weight"):
                a = _permute(a, cfg.num_key_value_heads)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(g, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@torch.no_grad()
def test_synthetic_gguf_matches_hf(tiny_hf_dirs, tmp_path, kind):
    hf, _ = tiny_hf_dirs[kind]
    path = str(tmp_path / f"tiny-{kind}.gguf")
    write_gguf(hf, path)
    loaded = load_model(ModelConfig(model=path), "cpu", torch.float32)
    a = loaded.arch
    assert a.arch == kind and a.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (a.rope_scaling or {}).get("rope_type") == ("factors" if kind == "llama" else None)
    assert loaded.tokenizer is None and loaded.name == f"tiny-{kind}"
    model = build_model(loaded)
    ids = torch.randint(3, 384, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    pos, meta = make_meta([(list(range(5)), 0, len(ids))], 16)
    got = model.compute_logits(model(torch.tensor(ids), pos, make_kv(a, 5, 16), meta))
    ref = hf(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_synthetic_q8_gguf_dequantizes(tiny_hf_dirs, tmp_path):
    """Q8_0 weights: our dequantized tensors equal gguf's own quantize->dequantize round trip
    (un-permuted), and logits stay close to the fp32 model."""
    hf, _ = tiny_hf_dirs["qwen2"]
    path = str(tmp_path / "q8.gguf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_gguf(hf, path, q8)
    w = dict(load_model(ModelConfig(model=path), "cpu", torch.float32).weights)
    src = hf.state_dict()["model.layers.1.mlp.up_proj.weight"].numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(src, q8), q8)
    assert np.array_equal(w["model.layers.1.mlp.up_proj.weight"].numpy(), want)
    model = build_model(load_model(ModelConfig(model=path), "cpu", torch.float32))
    ids = list(range(10, 40))
    pos, meta = make_meta([([0, 1], 0, len(ids))], 16)
    got = model.compute_logits(model(torch.tensor(ids), pos, make_kv(model.arch, 2, 16), meta))
    ref = hf(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()  # 8-bit weights
