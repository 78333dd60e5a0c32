"""Session fixtures shared by the engine tests: tiny random HF checkpoints saved once per run,
the embedded SmolLM2 GGUF (ours and HF's), and a helper that builds attention metadata.

HF transformers is only a test oracle here; serving code never imports it.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.layers.attention import AttentionMetadata

TINY_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def save_tiny_hf(kind: str, path: str, seed: int = 0):
    """A tiny random LlamaForCausalLM (llama3 rope scaling, untied) or Qwen2ForCausalLM (qkv
    bias, tied), saved as safetensors. Returns the HF model (fp32, eval)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **TINY_COMMON, tie_word_embeddings=False, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "llama-bias":  # attention_bias: q/k/v *and* o_proj biases in HF Llama
        cfg = transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=True, attention_bias=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY_COMMON, tie_word_embeddings=False, rope_theta=1e4,
                                         sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger than default init so logits differ visibly between tokens
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):  # weights and qwen2's qkv biases
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """kind -> (hf_model, dir) for llama / qwen2 / mistral / llama-bias, built once per session."""
    out = {}
    for kind in ("llama", "qwen2", "mistral", "llama-bias"):
        d = str(tmp_path_factory.mktemp(f"tiny-{kind}"))
        out[kind] = (save_tiny_hf(kind, d), d)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf():
    from engine.loader import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_gguf)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm2_gguf)
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """Our tokenizer from the embedded GGUF's metadata (no weights loaded)."""
    from engine.loader.gguf import _open, read_metadata
    from engine.loader.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(_open(smollm2_gguf)))


@pytest.fixture(scope="session")
def our_smollm2(smollm2_gguf):
    """(CausalLM fp32 on cpu, LoadedModel) for the embedded GGUF."""
    from engine.config import ModelConfig
    from engine.loader import load_model

    loaded = load_model(ModelConfig(model="default"), "cpu", torch.float32)
    return build_model(loaded), loaded


def build_model(loaded, dtype=torch.float32):
    from engine.layers.attention import TorchAttentionBackend
    from engine.models.llama import CausalLM

    a = loaded.arch
    model = CausalLM(a, TorchAttentionBackend(a.num_heads, a.num_kv_heads, a.head_dim), dtype=dtype)
    model.load_weights(loaded.weights)
    return model.eval()


def make_kv(arch, num_blocks: int, block_size: int, dtype=torch.float32) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_layers)]


def make_meta(seqs: list[tuple[list[int], int, int]], block_size: int):
    """seqs: (block_ids, start, n_new) per sequence -- n_new tokens at positions start..start+n-1.
    Returns (positions [T] long, AttentionMetadata)."""
    pos, slots, qsl, lens = [], [], [0], []
    for blocks, start, n in seqs:
        for p in range(start, start + n):
            pos.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
    width = max(len(b) for b, _, _ in seqs)
    bt = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, (blocks, _, _) in enumerate(seqs):
        bt[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=bt,
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(n for _, _, n in seqs), max_seq_len=max(lens), block_size=block_size,
        seq_lens_cpu=lens, query_start_loc_cpu=qsl, is_decode_only=all(n == 1 for _, _, n in seqs))
    return torch.tensor(pos, dtype=torch.long), meta
