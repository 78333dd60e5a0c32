"""GPU kernel benchmark + correctness check at real sizes (Llama-3.1-8B attention shapes).

    python3 bench/kernels_gpu.py [--sweep] [--commit SHA]   (SPLITSERVE_BENCH_DIR: JSON dir)

1. correctness of every Triton kernel vs its torch reference (real sizes, bf16 and fp8 KV),
   the Triton backend vs the torch backend, and a CUDA-graph capture/replay of the backend;
2. device copy bandwidth (the memory-bound ceiling);
3. paged decode attention GB/s (batch 32, ctx 4096, 32 q / 8 kv heads, d 128, bf16, block 16),
   fp8 KV, torch reference + dense SDPA timings; --sweep tunes block_n / warps / stages / splits
   at that shape (tiles x split counts over batches 1-128: lab/decode_ab.py);
4. varlen prefill attention TFLOP/s (causal), vs dense SDPA; --sweep tunes tiles;
5. KV write / RMSNorm / rotary bandwidth.
Kernel timings are CUDA-graph replays (20 calls per graph, median of replays) so Python/Triton
launch latency is excluded, as in the engine's graph-captured decode; eager times are kept too.
Prints tables; writes JSON (machine, GPU, git commit, date, config, results) via
bench.common.write_result (bench/results/ unless SPLITSERVE_BENCH_DIR is set).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import git_commit, print_table, write_result  # noqa: E402
from bench.timing import copy_bandwidth_gbs, cuda_time_ms, graph_time_ms  # noqa: E402
from engine.kernels.decode_attention import paged_decode_attention  # noqa: E402
from engine.kernels.kv_write import write_kv  # noqa: E402
from engine.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from engine.kernels.reference import (fused_add_rms_norm_ref, paged_attention_torch,  # noqa: E402
                                      rope_cos_sin_ref, rotary_neox_ref, write_kv_ref)
from engine.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402
from engine.kernels.rotary import rotary_neox_  # noqa: E402
from engine.layers.attention import KVScales, TorchAttentionBackend  # noqa: E402
from engine.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from tests.engine.kernels._util import make_batch  # noqa: E402

HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B
DEV = "cuda"
SHRINK = 1  # --smoke: tiny sizes on CPU under the Triton interpreter (checks the script)


def n(x: int) -> int:
    return max(1, x // SHRINK)
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def time_cuda(fn, warmup: int = 5, iters: int = 50) -> float:
    """Median milliseconds of fn() over `iters` runs, each bracketed by its own CUDA events."""
    if DEV == "cpu":  # --smoke
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return cuda_time_ms(fn, iters=iters, warmup=warmup)


def time_graph(fn, reps: int = 20, iters: int = 20) -> float | None:
    """Median ms of one fn() with host launch overhead removed: `reps` calls captured in one
    CUDA graph, replayed `iters` times. NOTE: eager time_cuda() includes the Python/Triton
    launch latency (tens of us per launch), which dominates small decode kernels."""
    if DEV == "cpu":
        return None
    try:
        return graph_time_ms([fn] * reps, iters=iters)
    except Exception as e:  # capture failed: report eager numbers only
        print(f"WARNING: CUDA-graph timing failed ({type(e).__name__}: {e}); eager only", file=sys.stderr)
        return None


def run_info(commit: str | None) -> dict:
    import triton

    if DEV == "cpu":
        return {"gpu": "none (smoke)", "triton": triton.__version__, "git_commit": git_commit()}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "sm_count": p.multi_processor_count,
            "gpu_mem_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "git_commit": commit or os.environ.get("GIT_COMMIT") or git_commit()}


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel(a, b) -> float:
    return _err(a, b) / max(b.float().abs().max().item(), 1e-30)


def check_correctness() -> list[dict]:
    rows = []

    def add(name, err, tol):
        rows.append({"check": name, "max_abs_err": err, "tol": tol, "ok": bool(err <= tol)})

    torch.manual_seed(0)
    # KV write, 3000 tokens (some padding) into a 16-token-block cache
    for dt in (BF16, FP8):
        T = n(3000)
        k = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
        v = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
        slots = torch.randperm(n(400) * 16, device=DEV)[:T]
        slots[::97] = -1
        a = torch.zeros(2, n(400), 16, HKV, D, device=DEV, dtype=dt)
        b = a.clone()
        ks = vs = torch.tensor(0.02, device=DEV)
        write_kv(k, v, a, slots, ks, vs)
        write_kv_ref(k, v, b, slots, ks, vs)
        # fraction of differing bytes (fp8: a rare one-step rounding tie may differ)
        add(f"kv_write {str(dt)[6:]} (diff frac)",
            float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean()), 0.0 if dt == BF16 else 1e-4)
    # decode: batch 32, odd context lengths up to 4096, bf16 and fp8
    lens = [int(x) for x in torch.randint(1, n(4097), (32,))]
    for dt in (BF16, FP8):
        kv, meta = make_batch(lens, [1] * 32, 16, HKV, D, BF16, DEV, kv_dtype=dt)
        q = torch.randn(32, HQ, D, device=DEV, dtype=BF16)
        ks, vs = torch.tensor(0.8, device=DEV), torch.tensor(1.2, device=DEV)
        out = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, D ** -0.5, ks, vs)
        ref = paged_attention_torch(q.float(), kv, meta, D ** -0.5, ks, vs)
        add(f"decode {str(dt)[6:]}", _err(out, ref), 2e-2)
    # prefill: fresh prompt, chunk over a cached prefix, decode rows; block size 32
    for dt in (BF16, FP8):
        seq_lens, q_lens = [n(1500), n(2600), 77, n(4096), 1], [n(1500), n(513), 1, 1, 1]
        kv, meta = make_batch(seq_lens, q_lens, 32, HKV, D, BF16, DEV, kv_dtype=dt)
        q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=BF16)
        ks, vs = torch.tensor(0.8, device=DEV), torch.tensor(1.2, device=DEV)
        out = paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      D ** -0.5, ks, vs)
        ref = paged_attention_torch(q.float(), kv, meta, D ** -0.5, ks, vs)
        add(f"prefill {str(dt)[6:]}", _err(out, ref), 2e-2)
    # fused add + RMSNorm, rotary at Llama-3.1-8B sizes
    x = torch.randn(n(4096), 4096, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    o, ro = fused_add_rms_norm(x, r, w, 1e-5)
    o2, ro2 = fused_add_rms_norm_ref(x, r, w, 1e-5)
    add("fused_add_rmsnorm (rel)", max(_rel(o, o2), _rel(ro, ro2)), 2e-2)
    cos, sin = rope_cos_sin_ref(8192, D, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (n(4096),), device=DEV)
    qkv = torch.randn(n(4096), HQ + 2 * HKV, D, device=DEV, dtype=BF16)
    qr, kr = rotary_neox_ref(pos, qkv[:, :HQ], qkv[:, HQ:HQ + HKV], cos, sin)
    rotary_neox_(pos, qkv[:, :HQ], qkv[:, HQ:HQ + HKV], cos, sin)
    add("rotary (rel)", max(_rel(qkv[:, :HQ], qr), _rel(qkv[:, HQ:HQ + HKV], kr)), 1e-2)
    # backend vs torch backend on a mixed batch, and a CUDA-graph replay of a decode step
    seq_lens, q_lens = [n(700), n(1200), 33, n(2048)], [n(700), n(100), 1, 1]
    kv, meta = make_batch(seq_lens, q_lens, 16, HKV, D, BF16, DEV)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=BF16) for h in (HQ, HKV, HKV))
    kt, kr_ = kv.clone(), kv.clone()
    ot = TritonAttentionBackend(HQ, HKV, D).forward(0, q, k, v, kt, meta)
    orf = TorchAttentionBackend(HQ, HKV, D).forward(0, q, k, v, kr_, meta)
    add("backend vs torch (mixed)", max(_err(ot, orf), _err(kt, kr_)), 2e-2)
    if DEV == "cuda":
        add("cuda graph decode replay", graph_replay_err(), 2e-2)
    return rows


def graph_replay_err() -> float:
    """Capture the Triton backend's decode step once, then replay it with longer contexts
    and new slots / inputs written into the same buffers; compare against eager."""
    S, bs = 16, 16
    lens = [int(x) for x in torch.randint(64, n(2048) + 65, (S,))]
    lens2 = [L + 37 for L in lens]
    kv, m2 = make_batch(lens2, [1] * S, bs, HKV, D, BF16, DEV)  # tables cover the longer lens
    bt = m2.block_tables

    def slots(ls):
        return torch.tensor([int(bt[i, (L - 1) // bs]) * bs + (L - 1) % bs for i, L in enumerate(ls)],
                            dtype=torch.long, device=DEV)

    meta = dataclasses.replace(m2, slot_mapping=slots(lens), block_tables=bt.clone(),
                               seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
                               seq_lens_cpu=None, query_start_loc_cpu=None)
    be = TritonAttentionBackend(HQ, HKV, D)
    q, k, v = (torch.randn(S, h, D, device=DEV, dtype=BF16) for h in (HQ, HKV, HKV))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(0, q, k, v, kv, meta)  # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = be.forward(0, q, k, v, kv, meta)
    meta.seq_lens.copy_(torch.tensor(lens2, dtype=torch.int32, device=DEV))
    meta.slot_mapping.copy_(slots(lens2))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    kv_ref = kv.clone()
    g.replay()
    torch.cuda.synchronize()
    ref = be.forward(0, q, k, v, kv_ref, meta)
    return max(_err(out, ref), _err(kv, kv_ref))


# ---------------------------------------------------------------------------- decode
# (block_n, num_warps, num_stages, prefetch) candidates for the sweep
DECODE_TILES = [(32, 4, 2, False), (64, 4, 3, False), (128, 8, 3, False), (128, 4, 3, False),
                (256, 8, 2, False), (256, 8, 1, False), (128, 8, 1, False), (32, 4, 2, True),
                (64, 2, 2, True), (64, 4, 2, True), (64, 8, 2, True), (128, 4, 2, True),
                (128, 8, 2, True)]
def bench_decode(sweep: bool, batch: int = 32, ctx: int = 4096, bs: int = 16) -> dict:
    lens = [ctx] * batch
    res = {"config": {"batch": batch, "ctx": ctx, "num_heads": HQ, "num_kv_heads": HKV,
                      "head_dim": D, "dtype": "bf16", "block_size": bs}, "runs": []}
    q = torch.randn(batch, HQ, D, device=DEV, dtype=BF16)
    scale = D ** -0.5
    for kv_dt in (BF16, FP8):
        kv, meta = make_batch(lens, [1] * batch, bs, HKV, D, BF16, DEV, kv_dtype=kv_dt)
        ks = vs = torch.tensor(1.0, device=DEV)
        kv_bytes = batch * ctx * HKV * D * 2 * kv.element_size()
        io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + meta.block_tables.numel() * 4

        def run(**kw):
            fn = lambda: paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, scale, ks, vs, **kw)  # noqa: E731
            ms = time_cuda(fn, warmup=10, iters=50)
            gms = time_graph(fn)
            row = {"impl": "triton", "kv": str(kv_dt)[6:], **{k: v for k, v in kw.items()},
                   "us_eager": ms * 1e3, "GB/s_eager": io_bytes / ms / 1e6,
                   "us": (gms or ms) * 1e3, "GB/s": io_bytes / (gms or ms) / 1e6}
            res["runs"].append(row)
            return row

        best = run()
        if sweep and kv_dt == BF16:
            for bn, nw, ns, pf in DECODE_TILES:
                r = run(block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf)
                best = r if r["GB/s"] > best["GB/s"] else best
            tile = {k: best[k] for k in ("block_n", "num_warps", "num_stages", "prefetch") if k in best}
            for sp in (1, 2, 3, 4, 8, 16):
                r = run(num_splits=sp, **tile)
                best = r if r["GB/s"] > best["GB/s"] else best
            res["best"] = best
        elif sweep:  # fp8: the best bf16 tile and a few others
            tile = {k: res["best"][k] for k in ("block_n", "num_warps", "num_stages", "prefetch")
                    if k in res["best"]}
            cands = [tile] + [dict(block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf)
                              for bn, nw, ns, pf in DECODE_TILES[-6:]]
            for t in cands:
                r = run(**t)
                best = r if r["GB/s"] > best["GB/s"] else best
            res["best_fp8"] = best
        if kv_dt == BF16:
            # torch reference (host loop over sequences) and dense SDPA on contiguous KV
            ms = time_cuda(lambda: paged_attention_torch(q, kv, meta, scale), warmup=2, iters=5)
            res["runs"].append({"impl": "torch_ref_paged", "kv": "bf16", "us": ms * 1e3,
                                "GB/s": io_bytes / ms / 1e6})
            kd = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=BF16)
            vd = torch.randn_like(kd)
            qd = q[:, :, None, :]
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)  # noqa: E731
            ms = time_cuda(sdpa, warmup=5, iters=50)
            gms = time_graph(sdpa) or ms
            res["runs"].append({"impl": "torch_sdpa_dense", "kv": "bf16", "us_eager": ms * 1e3,
                                "GB/s_eager": io_bytes / ms / 1e6, "us": gms * 1e3,
                                "GB/s": io_bytes / gms / 1e6})
            del kd, vd
        del kv
    return res


def bench_prefill(sweep: bool, nseq: int = 8, L: int = 2048, bs: int = 16) -> dict:
    res = {"config": {"num_seqs": nseq, "prompt_len": L, "num_heads": HQ, "num_kv_heads": HKV,
                      "head_dim": D, "dtype": "bf16", "block_size": bs, "causal": True}, "runs": []}
    kv, meta = make_batch([L] * nseq, [L] * nseq, bs, HKV, D, BF16, DEV)
    q = torch.randn(nseq * L, HQ, D, device=DEV, dtype=BF16)
    scale = D ** -0.5
    flops = nseq * 4 * HQ * D * (L * (L + 1) // 2)  # QK^T + PV over the causal triangle

    def run(**kw):
        fn = lambda: paged_prefill_attention(q, kv, meta.block_tables, meta.seq_lens,  # noqa: E731
                                             meta.query_start_loc, scale, **kw)
        ms = time_cuda(fn, warmup=5, iters=30)
        row = {"impl": "triton", **kw, "ms": ms, "TFLOP/s": flops / ms / 1e9}
        res["runs"].append(row)
        return row

    best = run()
    if sweep:
        for bm, bn, nw, ns in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3),
                               (128, 32, 4, 3), (128, 32, 8, 3), (128, 32, 4, 4), (64, 32, 4, 3),
                               (64, 32, 4, 4), (256, 32, 8, 3), (256, 64, 8, 2), (64, 64, 4, 4)]:
            try:
                r = run(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            except Exception as e:  # e.g. out of shared memory for a large tile
                res["runs"].append({"impl": "triton", "block_m": bm, "block_n": bn,
                                    "num_warps": nw, "num_stages": ns, "error": str(e)[:120]})
                continue
            best = r if r["TFLOP/s"] > best["TFLOP/s"] else best
        res["best"] = best
        # fp8 KV with the best tile
        tile = {k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages") if k in best}
        kv8 = kv.to(FP8)
        one = torch.tensor(1.0, device=DEV)
        ms = time_cuda(lambda: paged_prefill_attention(q, kv8, meta.block_tables, meta.seq_lens,
                                                       meta.query_start_loc, scale, one, one, **tile),
                       warmup=5, iters=30)
        res["runs"].append({"impl": "triton fp8 kv", **tile, "ms": ms, "TFLOP/s": flops / ms / 1e9})
        del kv8
    qd = q.view(nseq, L, HQ, D).transpose(1, 2)
    kd = torch.randn(nseq, HKV, L, D, device=DEV, dtype=BF16)
    vd = torch.randn_like(kd)
    ms = time_cuda(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                          enable_gqa=True), warmup=3, iters=20)
    res["runs"].append({"impl": "torch_sdpa_dense", "ms": ms, "TFLOP/s": flops / ms / 1e9})
    return res


# ---------------------------------------------------------------------------- small kernels
def bench_small() -> list[dict]:
    rows = []
    T = n(8192)
    k = torch.randn(T, HKV, D, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    cache = torch.zeros(2, T // 16 + 8, 16, HKV, D, device=DEV, dtype=BF16)
    slots = torch.randperm(T, device=DEV)
    ms = time_graph(lambda: write_kv(k, v, cache, slots)) or time_cuda(lambda: write_kv(k, v, cache, slots))  # launch overhead removed
    rows.append({"kernel": "kv_write bf16 (8192 tok)", "us": ms * 1e3, "GB/s": 4 * k.numel() * 2 / ms / 1e6})
    ms = time_cuda(lambda: write_kv_ref(k, v, cache, slots))
    rows.append({"kernel": "kv_write torch ref", "us": ms * 1e3, "GB/s": 4 * k.numel() * 2 / ms / 1e6})
    x = torch.randn(T, 4096, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    nbytes = 4 * x.numel() * 2  # read x, r; write out, residual
    ms = time_graph(lambda: fused_add_rms_norm(x, r, w, 1e-5)) or time_cuda(lambda: fused_add_rms_norm(x, r, w, 1e-5))  # launch overhead removed
    rows.append({"kernel": "fused_add_rmsnorm [8192,4096]", "us": ms * 1e3, "GB/s": nbytes / ms / 1e6})
    ms = time_cuda(lambda: fused_add_rms_norm_ref(x, r, w, 1e-5))
    rows.append({"kernel": "fused_add_rmsnorm torch ref", "us": ms * 1e3, "GB/s": nbytes / ms / 1e6})
    cos, sin = rope_cos_sin_ref(8192, D, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    qkv = torch.randn(T, HQ + 2 * HKV, D, device=DEV, dtype=BF16)
    qv, kvv = qkv[:, :HQ], qkv[:, HQ:HQ + HKV]
    nbytes = 2 * T * (HQ + HKV) * D * 2
    ms = time_graph(lambda: rotary_neox_(pos, qv, kvv, cos, sin)) or time_cuda(lambda: rotary_neox_(pos, qv, kvv, cos, sin))  # launch overhead removed
    rows.append({"kernel": "rotary neox (8192 tok)", "us": ms * 1e3, "GB/s": nbytes / ms / 1e6})
    ms = time_cuda(lambda: rotary_neox_ref(pos, qv, kvv, cos, sin))
    rows.append({"kernel": "rotary torch ref", "us": ms * 1e3, "GB/s": nbytes / ms / 1e6})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="tune tile / split parameters")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
    args = ap.parse_args()
    global DEV, SHRINK, HQ, HKV, D
    if args.smoke:
        DEV, SHRINK, HQ, HKV, D = "cpu", 64, 8, 2, 64
    elif not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    data = {"info": run_info(args.commit)}
    print(data["info"])
    if not args.skip_check:
        data["correctness"] = check_correctness()
        print("\n== correctness vs torch reference")
        print_table(data["correctness"], ["check", "max_abs_err", "tol", "ok"], float_fmt=".4g")
    copy = copy_bandwidth_gbs(n(2**30), DEV, timer=time_cuda)
    data["copy_GBps"] = copy
    print(f"\n== device copy bandwidth (read+write): {copy:.0f} GB/s")
    dec = bench_decode(args.sweep, batch=max(2, 32 // SHRINK), ctx=n(4096))
    data["decode"] = dec
    print("\n== paged decode attention (us / GB/s: CUDA-graph replay; us_eager: incl. launch)", dec["config"])
    for r in dec["runs"]:
        r["pct_copy"] = 100 * r["GB/s"] / copy
    print_table(dec["runs"], ["impl", "kv", "block_n", "num_warps", "num_stages", "prefetch", "num_splits",
                              "us_eager", "us", "GB/s", "pct_copy"], float_fmt=".4g")
    pre = bench_prefill(args.sweep, nseq=max(1, 8 // SHRINK), L=n(2048))
    data["prefill"] = pre
    print("\n== varlen prefill attention", pre["config"])
    print_table(pre["runs"], ["impl", "block_m", "block_n", "num_warps", "num_stages", "ms", "TFLOP/s", "error"],
                float_fmt=".4g")
    data["small"] = bench_small()
    print("\n== small kernels (Triton rows: CUDA-graph replay; torch refs: eager)")
    print_table(data["small"], ["kernel", "us", "GB/s"], float_fmt=".4g")
    info = data.pop("info")
    path = write_result("kernels_gpu", {"sweep": args.sweep, **info,
                                        "decode": dec["config"], "prefill": pre["config"]}, data)
    print("\nwrote", path)
    return 0 if all(r["ok"] for r in data.get("correctness", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
