"""Layer-level checks: rotary frequencies vs HF's rope init functions (default, linear,
llama3, GGUF per-frequency factors), rotary stays fp32 under model.to(bf16), RMSNorm and
SwiGLU vs their definitions, fused-linear shard loading."""
from __future__ import annotations

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.linear import MergedLinear
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

transformers = pytest.importorskip("transformers")

L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}


def _hf_inv_freq(scaling: dict | None, theta=500000.0, head_dim=128):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rp)
    rt = rp["rope_type"]
    if rt == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    inv, _ = ROPE_INIT_FUNCTIONS[rt](cfg, "cpu")
    return inv


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, L3])
def test_inv_freq_matches_hf(scaling):
    ours = compute_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(ours, _hf_inv_freq(scaling), rtol=1e-6, atol=0)


def test_gguf_rope_factors_equal_llama3():
    # llama.cpp stores rope_freqs = plain_inv / llama3_inv; applying them recovers llama3
    plain = compute_inv_freq(128, 500000.0, None)
    l3 = compute_inv_freq(128, 500000.0, L3)
    f = {"rope_type": "factors", "factors": tuple((plain / l3).tolist())}
    assert torch.allclose(compute_inv_freq(128, 500000.0, f), l3, rtol=1e-6)
    with pytest.raises(ValueError, match="factors"):
        compute_inv_freq(64, 500000.0, f)


def test_rotary_stays_fp32_under_cast():
    rot = RotaryEmbedding(64, 10000.0, None)
    want = rot.inv_freq.clone()
    rot.to(torch.bfloat16)
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, want)


def test_rotary_is_a_rotation_and_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = RotaryEmbedding(16, 10000.0, None)
    pos = torch.arange(7)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    rq, rk = rot(pos, q, k)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    cos, sin = rot.cos_sin(pos)
    cos2, sin2 = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # HF: [1, T, D]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos2, sin2)
    assert torch.allclose(rq, hq[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(rk, hk[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(apply_rotary(q[:0], cos[:0], sin[:0]), q[:0])


def test_rmsnorm_matches_hf_and_fused_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.1)
    ours = RMSNorm(32, 1e-5)
    ours.weight.data.copy_(hf.weight.data)
    x, r = torch.randn(5, 32), torch.randn(5, 32)
    assert torch.allclose(ours(x), hf(x), atol=1e-6)
    out, res = ours(x, r)
    assert torch.allclose(res, x + r) and torch.allclose(out, hf(x + r), atol=1e-6)


def test_silu_and_mul():
    x = torch.randn(3, 8)
    assert torch.allclose(SiluAndMul()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_merged_linear_shards():
    lin = MergedLinear(4, {"q": 6, "k": 2, "v": 2}, bias=True)
    parts = {n: torch.randn(s, 4) for n, s in lin.shard_sizes.items()}
    for n, w in parts.items():
        lin.load_shard(n, "weight", w)
        lin.load_shard(n, "bias", torch.zeros(lin.shard_sizes[n]))
    x = torch.randn(3, 4)
    q, k, v = lin.split(lin(x))
    assert torch.allclose(q, x @ parts["q"].T) and torch.allclose(v, x @ parts["v"].T)
    with pytest.raises(ValueError, match="shape"):
        lin.load_shard("k", "weight", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="unknown shard"):
        lin.load_shard("z", "weight", torch.zeros(2, 4))
    nob = MergedLinear(4, {"gate": 2, "up": 2})
    with pytest.raises(ValueError, match="no bias"):
        nob.load_shard("up", "bias", torch.zeros(2))
