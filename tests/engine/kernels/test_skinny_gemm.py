"""Skinny decode GEMM (engine/kernels/skinny_gemm.py) against its torch reference and
against the unfused HF-style sequence (norm -> linear -> silu*up -> + residual)."""
import pytest
import torch

from engine.kernels.reference import rms_norm_ref, skinny_linear_ref
from engine.kernels.skinny_configs import CUBLAS, SkinnyConfig, default_config
from engine.kernels.skinny_gemm import skinny_linear

from ._util import gemm_data, rel_err

FMA = SkinnyConfig(block_n=8, block_k=32, num_warps=4, num_stages=1, use_dot=False)
DOT = SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, use_dot=True)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,cfg", [(1, 40, 64, FMA), (1, 48, 100, FMA), (1, 33, 96, DOT),
                                       (3, 48, 100, DOT), (16, 32, 64, DOT), (5, 17, 40, DOT),
                                       (3, 21, 100, FMA), (8, 40, 64, FMA)])
def test_plain_and_bias(m, n, k, cfg, dtype, device):
    x, w, _, _, b = gemm_data(m, n, k, dtype, device, seed=m * 1000 + n + k)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poison: all written
    skinny_linear(x, w, out=out, config=cfg)
    assert rel_err(out, skinny_linear_ref(x, w)) < TOL[dtype]
    got = skinny_linear(x, w, b, config=cfg)
    assert rel_err(got, skinny_linear_ref(x, w, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,cfg", [(1, FMA), (1, DOT), (4, DOT), (3, FMA)])
def test_norm_silu_matches_unfused_sequence(m, cfg, dtype, device):
    n, k = 24, 72  # neither a multiple of the tiles
    x, w, nw, _, _ = gemm_data(m, n, k, dtype, device, seed=7 + m, silu=True)
    got = skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, config=cfg)
    assert got.shape == (m, n)
    assert rel_err(got, skinny_linear_ref(x, w, norm_weight=nw, eps=1e-5, silu=True)) < TOL[dtype]
    # the HF sequence: norm (rounded), fused gate|up matmul, silu(gate) * up
    h = rms_norm_ref(x, nw, 1e-5)
    gu = (h.float() @ w.float().T).to(dtype)
    want = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    assert rel_err(got, want) < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,cfg", [(1, FMA), (6, DOT), (5, FMA)])
def test_residual_in_place(m, cfg, dtype, device):
    n, k = 32, 80
    x, w, _, res, _ = gemm_data(m, n, k, dtype, device, seed=11 + m)
    want = skinny_linear_ref(x, w, residual=res)
    res0 = res.clone()
    out = skinny_linear(x, w, residual=res, out=res, config=cfg)
    assert out.data_ptr() == res.data_ptr()
    assert rel_err(res, want) < TOL[dtype]
    assert rel_err(res, (x.float() @ w.float().T).to(dtype).float() + res0.float()) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 2])
def test_norm_logits_fp32_out(m, device):
    """lm_head use: bf16 activations and weights, fused final norm, fp32 logits."""
    n, k = 70, 64
    x, w, nw, _, _ = gemm_data(m, n, k, torch.bfloat16, device, seed=3)
    cfg = default_config(m, n, k, torch.device(device))
    got = skinny_linear(x, w, norm_weight=nw, out_dtype=torch.float32, config=cfg)
    assert got.dtype == torch.float32
    want = rms_norm_ref(x, nw, 1e-6).float() @ w.float().T
    assert rel_err(got, want) < 2e-2


SPLIT_DOT = SkinnyConfig(block_n=16, block_k=16, num_warps=4, num_stages=1, use_dot=True, split_k=3)
SPLIT_FMA = SkinnyConfig(block_n=4, block_k=16, num_warps=4, num_stages=1, use_dot=False, split_k=4)
PREFETCH = SkinnyConfig(block_n=8, block_k=16, num_warps=4, num_stages=1, use_dot=False, prefetch_x=True)
PREFETCH_SPLIT = SkinnyConfig(block_n=16, block_k=16, num_warps=4, num_stages=1, use_dot=True,
                              split_k=2, prefetch_x=True)


WIDE_SPLIT = SkinnyConfig(block_n=128, block_k=32, num_warps=4, num_stages=3, use_dot=True,
                          split_k=2)  # one tile wider than N (masked rows) with split-K


@pytest.mark.parametrize("cfg", [SPLIT_DOT, SPLIT_FMA, PREFETCH, PREFETCH_SPLIT, WIDE_SPLIT])
@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (5, 33, 80), (3, 24, 128)])
def test_split_k_and_prefetch(cfg, m, n, k, device):
    """Split-K (last-arriver reduction) and x prefetch give the reference result with every
    fused epilogue, bit-identically across launches, and leave the arrival counters at 0."""
    from engine.kernels import skinny_gemm as sg

    dtype = torch.float32
    x, w2, nw, res, b = gemm_data(m, n, k, dtype, device, seed=m + n + k, silu=True)
    w = w2[:n].contiguous()
    cases = [dict(), dict(bias=b), dict(norm_weight=nw, eps=1e-5, silu=True, w=w2),
             dict(residual=res)]
    for case in cases:
        ww = case.pop("w", w)
        want = skinny_linear_ref(x, ww, **case)
        got = skinny_linear(x, ww, config=cfg, **case)
        assert rel_err(got, want) < TOL[dtype], case
        again = skinny_linear(x, ww, config=cfg, **case)
        assert torch.equal(got, again)  # deterministic: fixed split order
    r = res.clone()
    skinny_linear(x, w, residual=r, out=r, config=cfg)  # in place with splits
    assert rel_err(r, skinny_linear_ref(x, w, residual=res)) < TOL[dtype]
    for buf in sg._LOCKS.values():
        assert int(buf.abs().sum()) == 0


def test_k_split_never_empty():
    for k in (16, 40, 100, 4096, 14336):
        for bk in (16, 128, 256):
            for s in (1, 2, 3, 4, 8, 16, 64):
                c = SkinnyConfig(16, bk, 4, 1, True, split_k=s)
                splits, per = c.k_split(k)
                assert per % bk == 0 and 1 <= splits <= s
                assert (splits - 1) * per < k <= splits * per  # every split has >= 1 chunk


def test_split_k_bf16_matches_unsplit(device):
    m, n, k = 4, 48, 192
    x, w, nw, res, _ = gemm_data(m, n, k, torch.bfloat16, device, seed=5, silu=True)
    a = skinny_linear(x, w, norm_weight=nw, silu=True, config=SPLIT_DOT)
    b = skinny_linear(x, w, norm_weight=nw, silu=True, config=DOT)
    assert rel_err(a, b) < 1e-2


def test_bad_inputs(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        skinny_linear(x, torch.randn(4, 9, device=device))
    with pytest.raises(ValueError, match="even row count"):
        skinny_linear(x, torch.randn(5, 8, device=device), silu=True)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear(x, torch.randn(4, 8, device=device), residual=torch.randn(2, 5, device=device))


def test_default_config_sane():
    for m in (1, 2, 8, 16, 64):
        for n, k in ((4096, 4096), (6144, 4096), (14336, 4096), (128256, 2048), (2048, 8192)):
            c = default_config(m, n, k, torch.device("cpu"))
            assert c.block_m(m) >= m and c.block_n >= (16 if c.use_dot else 1)
            assert k % c.block_k == 0


def test_tuned_table_lookup(tmp_path, monkeypatch):
    import json

    from engine.kernels import skinny_configs as sc

    monkeypatch.setattr(sc, "CONFIG_DIR", str(tmp_path))
    sc.load_table.cache_clear()
    doc = {"device": "Fake GPU", "max_m": 2, "entries": [
        {"n": 64, "k": 32, "silu": False, "m": 1, "cfg": [4, 32, 8, 1, False]},
        {"n": 64, "k": 32, "silu": False, "m": 8, "cfg": [16, 32, 4, 3, True]}]}
    (tmp_path / "skinny_gemm-Fake_GPU.json").write_text(json.dumps(doc))
    try:
        assert sc.lookup("Fake GPU", 1, 64, 32, False) == (4, 32, 8, 1, False)
        assert sc.lookup("Fake GPU", 3, 64, 32, False) == (16, 32, 4, 3, True)  # next tuned m up
        assert sc.lookup("Fake GPU", 40, 64, 32, False) == (16, 32, 4, 3, True)  # past the largest
        assert sc.lookup("Fake GPU", 1, 64, 32, True) is None  # untuned shape: heuristic
        assert sc.lookup("Other GPU", 1, 64, 32, False) is None
        assert sc.table_max_m("Fake GPU") == 2
        assert sc.fused_rows("Fake GPU") is None  # no fused_m: every batch <= max_m
        doc2 = dict(doc, max_m=16, fused_m=[1, 16])
        doc2["entries"] = doc["entries"] + [
            {"n": 64, "k": 32, "silu": False, "m": 4, "cfg": [4, 32, 8, 1, False]},
            {"n": 64, "k": 32, "silu": False, "m": 16, "cfg": [16, 32, 4, 3, True, 2, True]}]
        (tmp_path / "skinny_gemm-Fake_GPU2.json").write_text(json.dumps(doc2))
        assert sc.lookup("Fake GPU2", 9, 64, 32, False) == (16, 32, 4, 3, True, 2, True)
        # buckets: 1 -> 1 (fused), 2..4 -> 4 (not), 5..8 -> 8 (not), 9..16 -> 16 (fused)
        assert sc.fused_rows("Fake GPU2", limit=20) == frozenset([1] + list(range(9, 17)))
        (tmp_path / "skinny_gemm-Bad.json").write_text("{not json")
        assert sc.lookup("Bad", 1, 64, 32, False) is None  # unreadable table: ignored, logged
    finally:
        sc.load_table.cache_clear()


def test_shipped_tables_are_valid():
    import glob
    import json
    import os

    from engine.kernels.skinny_configs import CONFIG_DIR

    paths = glob.glob(os.path.join(CONFIG_DIR, "skinny_gemm-*.json"))
    assert paths, "the H200 table is shipped"
    for p in paths:
        doc = json.load(open(p))
        assert isinstance(doc["max_m"], int) and 0 <= doc["max_m"] <= 64
        assert all(m <= doc["max_m"] for m in doc.get("fused_m", []))
        for e in doc["entries"]:
            c = SkinnyConfig.from_table(e["cfg"])
            assert c.to_table() == list(e["cfg"]) or len(e["cfg"]) < 8  # round trip
            if c.cublas:
                continue
            assert c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0
            assert e["k"] % c.block_k == 0 and c.num_warps in (1, 2, 4, 8, 16) and c.split_k >= 1
            if c.slab:  # a slab entry must be one the slab GEMV runs: one row, whole rows fit
                from engine.kernels.slab_gemv import MAX_K

                assert e["m"] == 1 and e["k"] <= MAX_K and c.slab >= 1 and c.block_n in (1, 2, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,cfg", [(3, SkinnyConfig(16, 16, 4, 1, True, split_k=2, norm_separate=True)),
                                   # the shipped 8B one-row gate_up: a whole row per program
                                   (1, SkinnyConfig(2, 128, 8, 1, False, norm_separate=True))])
def test_norm_separate_matches_hf_sequence(m, cfg, dtype, device):
    """norm_separate: rmsnorm kernel (rounded like HF) then the GEMM (split-K, or one-row
    whole-row tiles without a K loop)."""
    n, k = 40, 128
    x, w, nw, _, _ = gemm_data(m, n, k, dtype, device, seed=21, silu=True)
    got = skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, config=cfg)
    h = rms_norm_ref(x, nw, 1e-5)
    gu = (h.float() @ w.float().T).to(dtype)
    want = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    assert rel_err(got, want) < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cublas_route_matches_fused_kernel(dtype, device):
    """A table entry ["cublas"] runs the op unfused (rmsnorm, F.linear, torch epilogues) with
    the same interface: every epilogue, out= and the in-place residual."""
    m, n, k = 5, 24, 72
    x, w, nw, res, b = gemm_data(m, n, k, dtype, device, seed=33, silu=True)
    tol = TOL[dtype]
    want = skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, config=DOT)
    got = skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, config=CUBLAS)
    assert got.shape == (m, n) and rel_err(got, want) < tol
    wn = w[:n].contiguous()
    assert rel_err(skinny_linear(x, wn, b, config=CUBLAS), skinny_linear_ref(x, wn, b)) < tol
    r1, r2 = res.clone(), res.clone()
    skinny_linear(x, wn, residual=r1, out=r1, config=DOT)
    out = skinny_linear(x, wn, residual=r2, out=r2, config=CUBLAS)
    assert out.data_ptr() == r2.data_ptr() and rel_err(r2, r1) < tol
    r1, r2 = res.clone(), res.clone()  # silu then the residual
    skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, residual=r1, out=r1, config=DOT)
    skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, residual=r2, out=r2, config=CUBLAS)
    assert rel_err(r2, r1) < tol
    f32 = skinny_linear(x, wn, out_dtype=torch.float32, config=CUBLAS)
    assert f32.dtype == torch.float32 and rel_err(f32, skinny_linear_ref(x, wn)) < tol
    assert SkinnyConfig.from_table(["cublas"]) is CUBLAS and CUBLAS.to_table() == ["cublas"]
    # no epilogue: the matmul writes `out` itself (no copy), values exactly F.linear's
    xs = torch.cat([x, x], 1)[:, :k]  # x with a row stride
    for bias in (None, b):
        out = torch.empty(m, n, dtype=dtype, device=device)
        got = skinny_linear(xs, wn, bias, out=out, config=CUBLAS)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got, torch.nn.functional.linear(xs, wn, bias))
    wide = torch.empty(m, 2 * n, dtype=dtype, device=device)  # out with a row stride
    got = skinny_linear(x, wn, out=wide[:, :n], config=CUBLAS)
    assert torch.equal(wide[:, :n], torch.nn.functional.linear(x, wn))


ONE_FMA = SkinnyConfig(4, 128, 4, 1, False)  # K <= 128: the whole row in one chunk, no K loop
ONE_DOT = SkinnyConfig(16, 128, 4, 1, True)
ONE_SPLIT = SkinnyConfig(8, 32, 4, 1, False, split_k=4)  # K = 128: one chunk per split


@pytest.mark.parametrize("cfg", [ONE_FMA, ONE_DOT, ONE_SPLIT])
@pytest.mark.parametrize("m,n,k", [(1, 24, 128), (3, 20, 100), (1, 9, 77)])
def test_one_chunk_programs(cfg, m, n, k, device):
    """A program whose K range is a single chunk (ONE_CHUNK: no K loop) with every epilogue."""
    dtype = torch.float32
    x, w, nw, res, b = gemm_data(m, n, k, dtype, device, seed=3 * m + n + k, silu=True)
    wn = w[:n].contiguous()
    got = skinny_linear(x, w, norm_weight=nw, eps=1e-5, silu=True, config=cfg)
    assert rel_err(got, skinny_linear_ref(x, w, norm_weight=nw, eps=1e-5, silu=True)) < TOL[dtype]
    assert rel_err(skinny_linear(x, wn, b, config=cfg), skinny_linear_ref(x, wn, b)) < TOL[dtype]
    r = res.clone()
    skinny_linear(x, wn, residual=r, out=r, config=cfg)
    assert rel_err(r, skinny_linear_ref(x, wn, residual=res)) < TOL[dtype]


def test_skinny_table_option_replaces_the_gpus_table(tmp_path, monkeypatch):
    """KernelOptions.skinny_table: a candidate table file is looked up instead of the GPU's
    shipped one, each file cached apart (an A/B runs both in one process)."""
    import json

    from engine.kernels import skinny_configs as sc

    monkeypatch.setattr(sc, "CONFIG_DIR", str(tmp_path))
    doc = {"device": "Fake GPU", "max_m": 1, "entries": [
        {"n": 64, "k": 32, "silu": False, "m": 1, "cfg": [4, 32, 8, 1, False]}]}
    (tmp_path / "skinny_gemm-Fake_GPU.json").write_text(json.dumps(doc))
    doc["entries"][0]["cfg"][0], doc["max_m"] = 8, 2
    cand = tmp_path / "candidate.json"
    cand.write_text(json.dumps(doc))
    sc.forget_cached()
    try:
        assert sc.table_path("Fake GPU", str(cand)) == str(cand)
        assert sc.lookup("Fake GPU", 1, 64, 32, False)[0] == 4
        assert sc.lookup("Fake GPU", 1, 64, 32, False, str(cand))[0] == 8
        assert sc.lookup("Fake GPU", 1, 64, 32, False)[0] == 4  # the shipped one still
        assert (sc.table_max_m("Fake GPU"), sc.table_max_m("Fake GPU", str(cand))) == (1, 2)
    finally:
        sc.forget_cached()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,cfg", [(1, 40, 64, FMA), (1, 72, 100, FMA), (1, 33, 96, DOT), (2, 40, 64, FMA)])
def test_next_norm_is_the_rmsnorm_of_the_result(m, n, k, cfg, dtype, device):
    """next_norm: the matmul's last program (one row; more rows: the rmsnorm kernel after it)
    writes rmsnorm(out) * g with the rmsnorm kernel's rounding, and leaves its arrival count
    at zero for the next launch; the matmul's own result does not change. (The sum of squares
    is reduced in another thread layout than the rmsnorm kernel's, so on a GPU rstd may differ
    in its last fp32 bit: within 2 ulps of the output dtype; the interpreter gives equality.)"""
    from engine.kernels.rmsnorm import rms_norm
    from engine.kernels.skinny_gemm import _nn_count, next_norm_fuses

    x, w, _, res, _ = gemm_data(m, n, k, dtype, device, seed=31 + m + n)
    g = torch.randn(n, dtype=dtype, device=device)
    want = skinny_linear(x, w, residual=res.clone(), config=cfg)
    for _ in range(2):  # the count must be back at zero for the second launch
        r = res.clone()
        normed = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        skinny_linear(x, w, residual=r, out=r, config=cfg, next_norm=(g, 1e-5, normed))
        assert torch.equal(r, want)
        ref = rms_norm(r, g, 1e-5)
        ulps = 2 * torch.finfo(dtype).eps * ref.abs().float().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((normed.float() - ref.float()).abs() <= ulps).all())  # two roundings
        assert int(_nn_count(torch.device(device))[0]) == 0
    assert next_norm_fuses(m, n, k, torch.device(device)) == (m == 1)  # heuristic tiles, no split


def test_next_norm_bad_shapes(device):
    x, w, _, res, _ = gemm_data(1, 40, 64, torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="next_norm"):
        skinny_linear(x, w, residual=res, out=res, config=FMA,
                      next_norm=(torch.ones(39, device=device), 1e-5, torch.empty(1, 40, device=device)))
