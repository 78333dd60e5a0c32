"""The embedded SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0), dequantized and loaded by ours, gives
the same fp32 logits as HF transformers loading the same file (gguf_file=...)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.loader.gguf import hf_name, unpermute_qk
from tests.conftest import make_kv, make_meta

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load GGUF files

BS = 16
TOL = 1e-3
PROMPTS = ["The capital of France is Paris. The capital of Germany is",
           "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # what llama.cpp's convert_hf_to_gguf.py does to q/k rows of llama models
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, d in ((9, 64), (3, 64), (4, 16)):
        w = rng.standard_normal((n_head * d, 24)).astype(np.float32)
        assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
        b = rng.standard_normal((n_head * d,)).astype(np.float32)
        assert np.array_equal(unpermute_qk(_llama_cpp_permute(b, n_head), n_head), b)


def test_gguf_name_mapping():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def test_gguf_arch(our_smollm2):
    _, loaded = our_smollm2
    a = loaded.arch
    assert (a.arch, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert a.vocab_size == 49152 and a.tie_word_embeddings and a.rope_theta == 100000.0
    assert a.eos_token_ids == (2,) and a.bos_token_id == 1
    assert loaded.name == "SmolLM2-135M-Instruct"


@torch.no_grad()
def test_gguf_prefill_logits_match_hf(our_smollm2, hf_smollm2_model):
    model, loaded = our_smollm2
    tok = loaded.tokenizer
    seqs = [tok.encode(p) for p in PROMPTS]
    # both prompts in one flat batch, scattered blocks
    blocks = [[5, 1], [0, 3, 7]]
    pos, meta = make_meta([(b, 0, len(s)) for b, s in zip(blocks, seqs)], BS)
    logits = model.compute_logits(model(torch.tensor(sum(seqs, [])), pos, make_kv(loaded.arch, 8, BS), meta))
    off = 0
    for s in seqs:
        ref = hf_smollm2_model(torch.tensor([s])).logits[0].float()
        got = logits[off:off + len(s)]
        assert (got - ref).abs().max().item() < TOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        off += len(s)
    # sanity: the model is real, not noise
    last = logits[len(seqs[0]) - 1]
    assert tok.decode([int(last.argmax())]).strip() == "Berlin"


@torch.no_grad()
def test_gguf_decode_after_prefill_matches_hf(our_smollm2, hf_smollm2_model):
    model, loaded = our_smollm2
    ids = loaded.tokenizer.encode(PROMPTS[0])
    kv = make_kv(loaded.arch, 4, BS)
    pos, meta = make_meta([([3, 0], 0, len(ids))], BS)
    h = model(torch.tensor(ids), pos, kv, meta)
    nxt = int(model.compute_logits(h[-1:]).argmax())
    pos, meta = make_meta([([3, 0], len(ids), 1)], BS)
    got = model.compute_logits(model(torch.tensor([nxt]), pos, kv, meta))[0]
    ref = hf_smollm2_model(torch.tensor([ids + [nxt]])).logits[0, -1].float()
    assert (got - ref).abs().max().item() < TOL
