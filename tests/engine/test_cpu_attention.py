"""The torch backend's CPU path (engine/layers/attention_cpu.py) against the reference
(paged_attention_torch): decode rows batched, prompt rows with and without cached context,
mixed steps, GQA groups, block sizes, a 16-bit KV cache; and the plan is built once per step.
Every case runs twice: decode rows through torch ops, and through the C kernel
(engine/layers/attention_cpu_native.py)."""
import pytest
import torch

from engine.layers.attention import (TorchAttentionBackend, paged_attention_torch, write_kv_torch)
from tests.conftest import make_meta


@pytest.fixture(params=["torch", "native"])
def decode_path(request):
    """The cpu_decode a TorchAttentionBackend gets (None: torch ops)."""
    if request.param == "torch":
        return None
    from engine import cpu_native
    from engine.layers.attention_cpu_native import NativeDecode

    lib, why = cpu_native.load()
    if lib is None:
        pytest.skip(f"C kernel not built here: {why}")
    return NativeDecode(lib)


def _case(seqs, hq, hkv, d, bs, num_blocks, kv_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((2, num_blocks, bs, hkv, d), generator=g).to(kv_dtype)
    _, meta = make_meta(seqs, bs)
    t = int(meta.query_start_loc_cpu[-1])
    q = torch.randn((t, hq, d), generator=g)
    k = torch.randn((t, hkv, d), generator=g)
    v = torch.randn((t, hkv, d), generator=g)
    return q, k, v, cache, meta


def _blocks(n_tokens, bs, start_block):
    return list(range(start_block, start_block + -(-n_tokens // bs)))


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_reference_mixed(hq, hkv, bs, decode_path):
    # decode rows of varied length, a fresh prompt, a chunk after cached tokens, another decode
    # (start, n_new); the 200-token prompt is past the C kernel's prompt rows (NATIVE_PROMPT_MAX_CTX)
    lens = [(37, 1), (1, 1), (100, 1), (0, 23), (40, 9), (16, 1), (0, 200), (150, 30)]
    seqs, nxt = [], 1
    for start, n in lens:
        blocks = _blocks(start + n, bs, nxt)
        blocks = blocks[::-1] if len(blocks) > 1 else blocks  # not in order: a real page table
        nxt += len(blocks)
        seqs.append((blocks, start, n))
    q, k, v, cache, meta = _case(seqs, hq, hkv, 64, bs, nxt + 2)
    be = TorchAttentionBackend(hq, hkv, 64, cpu_decode=decode_path)
    ref_cache = cache.clone()
    write_kv_torch(k, v, ref_cache, meta.slot_mapping)
    ref = paged_attention_torch(q, ref_cache, meta, be.scale)
    out = be.forward(0, q, k, v, cache, meta)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_only_and_prompt_only(decode_path):
    bs = 16
    dec = [(_blocks(n + 1, bs, 1 + 10 * i), n, 1) for i, n in enumerate([5, 63, 64, 120])]
    pre = [(_blocks(n, bs, 1 + 10 * i), 0, n) for i, n in enumerate([7, 33])]
    for seqs in (dec, pre):
        q, k, v, cache, meta = _case(seqs, 9, 3, 64, bs, 64, seed=3)
        be = TorchAttentionBackend(9, 3, 64, cpu_decode=decode_path)
        ref_cache = cache.clone()
        write_kv_torch(k, v, ref_cache, meta.slot_mapping)
        ref = paged_attention_torch(q, ref_cache, meta, be.scale)
        torch.testing.assert_close(be.forward(0, q, k, v, cache, meta), ref, rtol=1e-5, atol=1e-5)


def test_bf16_kv_cache_reads_what_is_stored(decode_path):
    # fp32 compute, bf16 cache: a fresh prompt must see the rounded K/V like the reference
    bs = 16
    seqs = [(_blocks(20, bs, 1), 0, 20), (_blocks(9, bs, 3), 8, 1)]
    q, k, v, cache, meta = _case(seqs, 4, 2, 32, bs, 8, kv_dtype=torch.bfloat16, seed=5)
    be = TorchAttentionBackend(4, 2, 32, cpu_decode=decode_path)
    ref_cache = cache.clone()
    write_kv_torch(k, v, ref_cache, meta.slot_mapping)
    ref = paged_attention_torch(q, ref_cache, meta, be.scale)
    torch.testing.assert_close(be.forward(0, q, k, v, cache, meta), ref, rtol=1e-5, atol=1e-5)


def test_plan_built_once_per_step(monkeypatch):
    import engine.layers.attention_cpu as ac

    calls = []
    real = ac.build_plan
    monkeypatch.setattr(ac, "build_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seqs = [(_blocks(30, 16, 1), 29, 1), (_blocks(3, 16, 4), 0, 3)]
    q, k, v, cache, meta = _case(seqs, 4, 2, 32, 16, 8)
    be = TorchAttentionBackend(4, 2, 32)
    for layer in range(3):
        be.forward(layer, q, k, v, cache.clone(), meta)
    assert len(calls) == 1


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
def test_fresh_prompts_batched_by_length_match_the_reference(hq, hkv, decode_path):
    """Several fresh prompts in one step (grouped and right-padded into shared SDPA calls) next
    to decode rows and a chunk after cached tokens."""
    from engine.layers.attention_cpu import fresh_groups

    bs, seqs, nxt = 16, [], 1
    for start, n in [(0, 7), (0, 8), (0, 9), (20, 1), (0, 33), (0, 40), (0, 2), (16, 5), (0, 120)]:
        blocks = _blocks(start + n, bs, nxt)
        nxt += len(blocks)
        seqs.append((blocks, start, n))
    q, k, v, cache, meta = _case(seqs, hq, hkv, 64, bs, nxt + 2, seed=5)
    be = TorchAttentionBackend(hq, hkv, 64, cpu_decode=decode_path)
    ref_cache = cache.clone()
    write_kv_torch(k, v, ref_cache, meta.slot_mapping)
    ref = paged_attention_torch(q, ref_cache, meta, be.scale)
    torch.testing.assert_close(be.forward(0, q, k, v, cache, meta), ref, rtol=1e-5, atol=1e-5)
    groups = fresh_groups([(0, n, n, i) for i, n in enumerate([7, 8, 9, 33, 40, 2, 120])])
    assert sorted(r[1] for g in groups for r in g) == [2, 7, 8, 9, 33, 40, 120]
    assert any(len(g) >= 3 for g in groups)  # 7, 8, 9 share a call
    for g in groups:  # padding bounded by the slack
        assert len(g) * max(r[1] for r in g) <= 1.3 * sum(r[1] for r in g) + 1e-9
