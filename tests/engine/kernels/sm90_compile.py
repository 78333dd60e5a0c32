"""Compile the engine's GPU kernels for sm_90 (H100 / H200) on a machine without a GPU, the way
a GPU launch specializes them (pointers and strides 16-divisible), and report per variant
whether it compiled, whether the PTX has the PDL grid-dependency instructions, and the
registers / spills ptxas reports. The Triton interpreter never runs the PDL branches or the
compiler's lowering, so this is CI's only check of that code
(tests/engine/kernels/test_sm90_compile.py runs it in a subprocess: the kernel tests'
interpreter mode must be off for it).

    python -m tests.engine.kernels.sm90_compile     -> one JSON object per line
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

FLOATS = {"eps", "sm_scale", "nn_eps"}
I32_PTRS = {"nn_cnt_ptr", "lock_ptr", "bt_ptr", "seq_lens_ptr", "idx_ptr", "slot_ptr", "qsl_ptr"}
F32_PTRS = {"ws_ptr", "ssq_ws_ptr", "part_o_ptr", "part_lse_ptr", "cos_ptr", "sin_ptr",
            "k_scale_ptr", "v_scale_ptr"}
SPLIT = dict(G=4, G_PAD=16, D=128, D_PAD=128, BS=16, BLOCK_N=128, DIRECT=False, IS_FP8=False,
             PREC=None, UPCAST=False, PREFETCH=False, ROPE=True)
SKINNY = dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=4096, SPLIT_K=1, PREFETCH_X=False, ONE_CHUNK=True,
              NORM=False, SILU=True, RESID=False, HAS_BIAS=False, USE_DOT=False, EVEN_K=True,
              EVEN_N=True, PREC=None, UPCAST=False)
SLAB = dict(R=2, BLOCK_K=4096, NORM=True, SILU=False, RESID=False, HAS_BIAS=False, EVEN_K=True)
ROPE_KV = dict(HQ=32, HK=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, IS_FP8=False)

# (module, kernel, constexprs, num_warps, num_stages, pointer dtype overrides)
VARIANTS = [
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=1), 8, 3, {}),
    # the batch tile (TILE_16BIT_BATCH): 64-token tiles on 4 warps, no split
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=1, BLOCK_N=64, DIRECT=True), 4, 2, {}),
    # the few-sequence tile (TILE_16BIT_FEW): 64-token tiles on 4 warps, split
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=1, BLOCK_N=64), 4, 2, {}),
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=2, ROPE=False), 8, 3, {}),
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=0, ROPE=False, IS_FP8=True, BLOCK_N=64),
     4, 2, {"cache_ptr": "*fp8e4nv"}),
    ("decode_attention", "_decode_reduce_kernel", dict(D=128, D_PAD=128, SPLITS_PAD=64, PDL=1), 4, 1, {}),
    ("decode_attention", "_decode_reduce_kernel", dict(D=128, D_PAD=128, SPLITS_PAD=64, PDL=2), 4, 1, {}),
    ("skinny_gemm", "_skinny_gemm_kernel", dict(SKINNY, PDL=1), 8, 1, {}),
    ("skinny_gemm", "_skinny_gemm_kernel", dict(SKINNY, PDL=2, ONE_CHUNK=False, BLOCK_K=512, SILU=False,
                                                RESID=True), 4, 3, {}),
    ("skinny_gemm", "_skinny_gemm_kernel", dict(SKINNY, PDL=1, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128,
                                                ONE_CHUNK=False, USE_DOT=True, SPLIT_K=2, NORM=True,
                                                SILU=False), 4, 3, {}),
    ("slab_gemv", "_slab_gemv_kernel", dict(SLAB, PDL=1), 8, 1, {}),
    ("slab_gemv", "_slab_gemv_kernel", dict(SLAB, PDL=2, NORM=False, SILU=True, R=1), 8, 1, {}),
    ("rmsnorm", "_rmsnorm_kernel", dict(N=4096, BLOCK=4096, HAS_RES=False, PDL=1), 8, 1, {}),
    ("rmsnorm", "_rmsnorm_kernel", dict(N=4096, BLOCK=4096, HAS_RES=True, PDL=0), 8, 1, {}),
    ("rope_kv_write", "_rope_kv_write_kernel", dict(ROPE_KV, PDL=2), 4, 1, {}),
    # the next matmul's rmsnorm by the last program (skinny_linear's next_norm), o_proj's tile
    ("skinny_gemm", "_skinny_gemm_kernel", dict(SKINNY, PDL=1, ONE_CHUNK=False, BLOCK_N=4, BLOCK_K=512,
                                                SILU=False, RESID=True, NEXT_NORM=True, NN_BLOCK=4096), 4, 3, {}),
    # in-kernel timestamps (engine/kernels/trace.py, a GPU-only diagnostic)
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=1, TRACE=1), 8, 3, {}),
    ("decode_attention", "_decode_split_kernel", dict(SPLIT, PDL=1, TRACE=2), 8, 3, {}),
    ("decode_attention", "_decode_reduce_kernel", dict(D=128, D_PAD=128, SPLITS_PAD=64, PDL=1, TRACE=1), 4, 1, {}),
    ("skinny_gemm", "_skinny_gemm_kernel", dict(SKINNY, PDL=1, TRACE=1), 8, 1, {}),
    ("slab_gemv", "_slab_gemv_kernel", dict(SLAB, PDL=1, TRACE=1), 8, 1, {}),
    ("rmsnorm", "_rmsnorm_kernel", dict(N=4096, BLOCK=4096, HAS_RES=False, PDL=0, TRACE=1), 8, 1, {}),
    ("prefill_attention", "_prefill_kernel", dict(G=4, G_PAD=4, D=128, D_PAD=128, BS=16, BLOCK_Q=64,
                                                   BLOCK_N=64, IS_FP8=False, PREC=None, UPCAST=False), 4, 2, {}),
]


def _signature(fn, constexprs: dict, overrides: dict):
    names = list(inspect.signature(fn.fn).parameters)
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = overrides.get(name) or ("*i64" if name == "trace_ptr" else
                                                "*i32" if name in I32_PTRS else
                                                "*fp32" if name in F32_PTRS else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") or name in ("N", "K", "K_PER", "up_off", "rows_per_prog"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_variant(module: str, kernel: str, constexprs: dict, warps: int, stages: int,
                    overrides: dict) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"engine.kernels.{module}"), kernel)
    params = inspect.signature(fn.fn).parameters
    if "TRACE" in params:
        constexprs = {"TRACE": 0, **constexprs}
    if "NEXT_NORM" in params:
        constexprs = {"NEXT_NORM": False, "NN_BLOCK": 1, **constexprs}
    sig, attrs = _signature(fn, constexprs, overrides)
    row = {"kernel": kernel, "variant": {k: v for k, v in constexprs.items()
                                         if k in ("PDL", "ROPE", "USE_DOT", "IS_FP8", "SPLIT_K", "TRACE")}}
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    ptx = k.asm["ptx"]
    row.update(ok=True, has_wait="griddepcontrol.wait" in ptx,
               has_trigger="griddepcontrol.launch_dependents" in ptx, has_timer="%globaltimer" in ptx,
               shared=k.metadata.shared)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(ptxas):  # registers: informative only (they differ between releases)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx))
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True)
        os.unlink(f.name)
        regs = re.findall(r"Used (\d+) registers", r.stdout + r.stderr)
        row["regs"] = int(regs[0]) if regs else None
    return row


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    for v in VARIANTS:
        print(json.dumps(compile_variant(*v)), flush=True)


if __name__ == "__main__":
    main()
