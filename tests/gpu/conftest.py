"""Fixtures shared by the GPU tests (each test module skips itself without CUDA)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A small Llama-3-style checkpoint (real head_dim 64/128, GQA 4:1) with random weights.
    Returns (path, the HF model in fp32 on CPU); never cast the model in place (deepcopy)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("llama-gpu")
    m.save_pretrained(path, safe_serialization=True)
    return str(path), m
