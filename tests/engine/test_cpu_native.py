"""The CPU C kernels (engine/cpu_native.py, engine/csrc/paged_decode_cpu.c): the paged decode
attention against the torch reference over shapes the batched tests do not reach (long contexts
over many blocks, one sequence split across threads by kv heads, Llama-8B's head shape, strided
query rows, extreme scores), the build cache, and the fallbacks without a compiler."""
import ctypes

import pytest
import torch

from engine import cpu_native
from engine.layers.attention import paged_attention_torch
from engine.layers.attention_cpu_native import NativeDecode, make
from tests.conftest import make_meta


@pytest.fixture(scope="module")
def nd():
    lib, why = cpu_native.load()
    if lib is None:
        pytest.skip(f"C kernel not built here: {why}")
    return NativeDecode(lib)


def _decode_case(lens, hq, hkv, d, bs, kv_dtype=torch.float32, seed=0, q_scale=1.0):
    """Decode rows of the given context lengths over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // bs) for n in lens) + 3
    order = torch.randperm(nblocks - 1, generator=g).add(1).tolist()  # block 0 unused
    seqs, at = [], 0
    for n in lens:
        k = -(-n // bs)
        seqs.append((order[at:at + k], n - 1, 1))
        at += k
    _, meta = make_meta(seqs, bs)
    cache = torch.randn((2, nblocks, bs, hkv, d), generator=g).to(kv_dtype)
    q = torch.randn((len(lens), hq, d), generator=g) * q_scale
    return q, cache, meta


def _run(nd, q, cache, meta, scale, rows=None):
    out = torch.zeros_like(q)
    nd(q, cache, out, rows, meta.block_tables.to(torch.int32), meta.seq_lens.to(torch.int32), scale)
    return out


@pytest.mark.parametrize("lens,hq,hkv,d,bs", [
    ([1, 2, 17, 300, 1000], 9, 3, 64, 16),   # SmolLM2's heads, up to 63 blocks
    ([2048], 32, 8, 128, 16),                # one long Llama-8B row: split by kv heads
    ([5, 40], 8, 8, 128, 32),                # no grouping
    ([33, 7, 64, 65], 64, 1, 32, 8),         # 64 query heads on one kv head (the limit)
])
def test_matches_reference(nd, lens, hq, hkv, d, bs):
    q, cache, meta = _decode_case(lens, hq, hkv, d, bs)
    scale = d ** -0.5
    ref = paged_attention_torch(q, cache, meta, scale)
    torch.testing.assert_close(_run(nd, q, cache, meta, scale), ref, rtol=2e-5, atol=2e-5)


def test_bf16_cache_and_peaked_scores(nd):
    # scores spanning hundreds: weights underflow to 0 (denormals flushed), no inf / nan
    q, cache, meta = _decode_case([90, 3, 257], 9, 3, 64, 16, kv_dtype=torch.bfloat16, seed=2,
                                  q_scale=40.0)
    ref = paged_attention_torch(q, cache, meta, 0.125)
    out = _run(nd, q, cache, meta, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def test_strided_rows_written_in_place(nd):
    # q rows inside a wider [T, Hq + 2 Hkv, D] buffer (as a fused qkv output), decode rows 1 and 3
    q0, cache, meta = _decode_case([20, 50], 4, 2, 32, 16, seed=3)
    qkv = torch.randn(4, 8, 32)
    qkv[1, :4], qkv[3, :4] = q0[0], q0[1]
    q = qkv[:, :4]
    out = torch.full((4, 4, 32), 7.0)
    nd(q, cache, out, torch.tensor([1, 3]), meta.block_tables.to(torch.int32),
       meta.seq_lens.to(torch.int32), 32 ** -0.5)
    ref = paged_attention_torch(q0, cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out[[1, 3]], ref, rtol=2e-5, atol=2e-5)
    assert (out[[0, 2]] == 7.0).all()  # other rows untouched


def test_supports_says_no_to_what_it_cannot_run(nd):
    cache = torch.zeros(2, 4, 16, 2, 32)
    assert nd.supports(torch.zeros(1, 4, 32), cache)
    assert not nd.supports(torch.zeros(1, 4, 32, dtype=torch.bfloat16), cache)  # fp32 queries only
    assert not nd.supports(torch.zeros(1, 4, 32), cache.half())
    assert not nd.supports(torch.zeros(1, 4, 512), torch.zeros(2, 4, 16, 2, 512))  # head_dim > 256


def test_build_is_cached_and_keyed_by_source(tmp_path, monkeypatch):
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    lib, why = cpu_native.load(src)
    assert why == "" and lib.answer() == 42
    built = list((tmp_path / "splitserve" / "cpu_kernels").glob("k-*.so"))
    assert len(built) == 1
    assert cpu_native._build(cpu_native.compiler(), src, built[0].parent) == built[0]  # cached
    src.write_text("int answer(void) { return 43; }\n")
    other = cpu_native._build(cpu_native.compiler(), src, built[0].parent)
    assert other != built[0] and ctypes.CDLL(str(other)).answer() == 43


def test_a_header_edit_rebuilds(tmp_path):
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler")
    (tmp_path / "h.h").write_text("#define ANSWER 42\n")
    src = tmp_path / "k.c"
    src.write_text('#include "h.h"\nint answer(void) { return ANSWER; }\n')
    out = tmp_path / "built"
    first = cpu_native._build(cpu_native.compiler(), src, out)
    (tmp_path / "h.h").write_text("#define ANSWER 43\n")
    second = cpu_native._build(cpu_native.compiler(), src, out)
    assert second != first and ctypes.CDLL(str(second)).answer() == 43


def test_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_native, "compiler", lambda: None)
    src = tmp_path / "none.c"
    src.write_text("int x;\n")
    lib, why = cpu_native.load(src)
    assert lib is None and "no C compiler" in why
    monkeypatch.setattr(cpu_native, "load", lambda src=cpu_native.SRC: (None, "no C compiler"))
    assert make("auto") is None  # torch ops serve
    assert make("torch") is None
    with pytest.raises(RuntimeError, match="no C compiler"):
        make("native")
    with pytest.raises(ValueError, match="cpu_kernels"):
        make("fast")


def test_a_broken_source_is_reported(tmp_path, monkeypatch):
    if cpu_native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = tmp_path / "bad.c"
    src.write_text("int broken( {\n")
    lib, why = cpu_native.load(src)
    assert lib is None and "build of bad.c failed" in why


def test_plan_gives_the_kernel_decode_rows_and_short_prompts(nd):
    from engine.layers.attention_cpu import NATIVE_PROMPT_MAX_CTX, build_plan

    long_n = NATIVE_PROMPT_MAX_CTX + 40
    seqs = [(list(range(1, 1 + -(-long_n // 16))), 0, long_n), (list(range(40, 42)), 0, 20),
            (list(range(50, 52)), 30, 1)]
    _, meta = make_meta(seqs, 16)
    plan = build_plan(meta, 4, 2, torch.float32, torch.device("cpu"), nd)
    assert [r[2] for r in plan.prompt_rows] == [long_n]  # the long prompt stays on torch ops
    assert plan.seq_lens.tolist() == [31] + list(range(1, 21))  # decode row, then causal prefixes
    assert plan.decode_rows.tolist() == [long_n + 20] + list(range(long_n, long_n + 20))
    assert plan.block_tables[0, :2].tolist() == [50, 51] and plan.block_tables[1, :2].tolist() == [40, 41]
