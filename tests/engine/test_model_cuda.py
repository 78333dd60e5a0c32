"""On a CUDA GPU (skipped elsewhere): the model with its CUDA paths (Triton RMSNorm and
rotary, torch or Triton attention) matches HF on tiny checkpoints; bf16 keeps rotary
frequencies in fp32; a dummy Llama-3.2-1B builds on the GPU and runs prefill + decode."""
from __future__ import annotations

import time

import pytest
import torch

from engine.config import ModelConfig
from engine.layers.attention_select import get_attention_backend
from engine.loader import load_model
from engine.models.llama import CausalLM
from tests.conftest import make_meta

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("transformers")
BS = 16


def _build(spec, dtype, backend="torch", seed=0):
    loaded = load_model(ModelConfig(model=spec, seed=seed), "cuda", dtype)
    a = loaded.arch
    be = get_attention_backend(backend, "cuda", a.num_heads, a.num_kv_heads, a.head_dim)
    with torch.device("cuda"):
        m = CausalLM(a, be, dtype=dtype)
    m.load_weights(loaded.weights)
    return m.eval(), a


def _kv(a, n, dtype):
    return [torch.zeros((2, n, BS, a.num_kv_heads, a.head_dim), dtype=dtype, device="cuda")
            for _ in range(a.num_layers)]


def _meta(seqs):
    pos, meta = make_meta(seqs, BS)
    for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, f, getattr(meta, f).cuda())
    return pos.cuda(), meta


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.no_grad()
def test_cuda_fp32_matches_hf(tiny_hf_dirs, kind, backend):
    hf, path = tiny_hf_dirs[kind]
    m, a = _build(path, torch.float32, backend)
    g = torch.Generator().manual_seed(0)
    s1, s2 = torch.randint(3, 384, (70,), generator=g).tolist(), torch.randint(3, 384, (9,), generator=g).tolist()
    kv = _kv(a, 10, torch.float32)
    pos, meta = _meta([([4, 1, 8, 0, 2], 0, 69), ([7], 0, 8)])
    m(torch.tensor(s1[:69] + s2[:8], device="cuda"), pos, kv, meta)
    pos, meta = _meta([([4, 1, 8, 0, 2], 69, 1), ([7], 8, 1)])
    got = m.compute_logits(m(torch.tensor([s1[69], s2[8]], device="cuda"), pos, kv, meta)).cpu()
    ref = torch.stack([hf(torch.tensor([s1])).logits[0, -1], hf(torch.tensor([s2])).logits[0, -1]])
    tol = 2e-3 if backend == "torch" else 2e-2  # Triton dots may run in tf32
    assert (got - ref).abs().max().item() < tol


@torch.no_grad()
def test_cuda_bf16_close_and_rope_fp32(tiny_hf_dirs):
    hf, path = tiny_hf_dirs["llama"]
    m, a = _build(path, torch.bfloat16)
    m.to(device="cuda", dtype=torch.bfloat16)  # what the engine does after load_weights
    assert m.rotary.inv_freq.dtype == torch.float32 and m.rotary.inv_freq.is_cuda
    ids = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    pos, meta = _meta([([0, 1, 2], 0, 40)])
    got = m.compute_logits(m(torch.tensor(ids, device="cuda"), pos, _kv(a, 3, torch.bfloat16), meta)).cpu()
    ref = hf(torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()


@torch.no_grad()
def test_dummy_1b_on_gpu():
    t0 = time.perf_counter()
    m, a = _build("dummy:llama-3.2-1b", torch.bfloat16, "triton")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    kv = _kv(a, 40, torch.bfloat16)
    blocks = list(range(33))
    pos, meta = _meta([(blocks, 0, 512)])
    ids = torch.randint(0, a.vocab_size, (512,), device="cuda")
    h = m(ids, pos, kv, meta)
    pos, meta = _meta([(blocks, 512, 1)])
    logits = m.compute_logits(m(ids[:1], pos, kv, meta))
    assert logits.shape == (1, a.vocab_size) and torch.isfinite(logits).all() and torch.isfinite(h).all()
    print(f"dummy llama-3.2-1b: built + loaded on GPU in {load_s:.2f}s")
