"""Our CausalLM (loaded through the hf_dir loader) matches HF transformers' logits on tiny
random Llama (llama3 rope scaling, untied), Qwen2 (qkv bias, tied) and Mistral checkpoints:
a single prefill, a batch of sequences, and prefill-then-decode reading the paged cache."""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.loader import load_model
from tests.conftest import build_model, make_kv, make_meta

pytest.importorskip("transformers")

BS = 16
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "llama-bias"])
def pair(request, tiny_hf_dirs):
    hf, path = tiny_hf_dirs[request.param]
    loaded = load_model(ModelConfig(model=path), "cpu", torch.float32)
    return hf, build_model(loaded), loaded.arch, request.param, path


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def test_arch_from_config(pair):
    _, _, arch, kind, _ = pair
    assert arch.arch == kind.removesuffix("-bias")
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 16)
    assert arch.attention_bias == (kind in ("qwen2", "llama-bias"))
    assert arch.o_proj_bias == (kind == "llama-bias")
    assert arch.tie_word_embeddings == (kind in ("qwen2", "llama-bias"))
    if kind == "llama":
        assert arch.rope_scaling["rope_type"] == "llama3"
        assert arch.rope_theta == 10000.0
    assert arch.eos_token_ids == (2,)


@torch.no_grad()
def test_single_prefill_matches_hf(pair):
    hf, ours, arch, _, _ = pair
    ids = _ids(70, 1)  # > 64 = original_max_position_embeddings: exercises scaled frequencies
    kv = make_kv(arch, 8, BS)
    pos, meta = make_meta([([3, 1, 5, 0, 7], 0, len(ids))], BS)
    hidden = ours(torch.tensor(ids), pos, kv, meta)
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (70, arch.vocab_size)
    ref = _hf_logits(hf, ids)
    assert (logits - ref).abs().max().item() < TOL


@torch.no_grad()
def test_batched_prefill_matches_hf(pair):
    hf, ours, arch, _, _ = pair
    seqs = [_ids(5, 2), _ids(33, 3), _ids(17, 4)]
    kv = make_kv(arch, 12, BS)
    blocks = [[0], [1, 2, 3], [4, 5]]
    pos, meta = make_meta([(b, 0, len(s)) for b, s in zip(blocks, seqs)], BS)
    logits = ours.compute_logits(ours(torch.tensor(sum(seqs, [])), pos, kv, meta))
    off = 0
    for s in seqs:
        ref = _hf_logits(hf, s)
        assert (logits[off:off + len(s)] - ref).abs().max().item() < TOL
        off += len(s)


@torch.no_grad()
def test_prefill_then_decode_reads_cache(pair):
    """Step 1: prefill two prompts. Step 2: chunk of 3 for one and decode for the other, one
    batch: the new tokens must see the cached K/V exactly as a full HF forward does."""
    hf, ours, arch, _, _ = pair
    a, b = _ids(20, 5), _ids(9, 6)
    a_next, b_next = _ids(3, 7), _ids(1, 8)
    kv = make_kv(arch, 10, BS)
    ba, bb = [2, 6], [9]
    pos, meta = make_meta([(ba, 0, len(a)), (bb, 0, len(b))], BS)
    ours(torch.tensor(a + b), pos, kv, meta)
    pos, meta = make_meta([(ba, len(a), 3), (bb, len(b), 1)], BS)
    logits = ours.compute_logits(ours(torch.tensor(a_next + b_next), pos, kv, meta))
    ref_a = _hf_logits(hf, a + a_next)[-3:]
    ref_b = _hf_logits(hf, b + b_next)[-1:]
    assert (logits[:3] - ref_a).abs().max().item() < TOL
    assert (logits[3:] - ref_b).abs().max().item() < TOL


@torch.no_grad()
def test_bf16_close_to_fp32(pair):
    """Same weights in bf16: logits stay close (loose tolerance)."""
    _, ours, arch, _, path = pair
    loaded = load_model(ModelConfig(model=path), "cpu", torch.bfloat16)
    low = build_model(loaded, dtype=torch.bfloat16)
    ids = _ids(24, 9)
    pos, meta = make_meta([([0, 1], 0, len(ids))], BS)
    hi = ours.compute_logits(ours(torch.tensor(ids), pos, make_kv(arch, 2, BS), meta))
    lo = low.compute_logits(low(torch.tensor(ids), pos, make_kv(arch, 2, BS, torch.bfloat16), meta))
    assert lo.dtype == torch.float32
    assert torch.allclose(lo, hi, atol=0.15 * hi.abs().max().item())
