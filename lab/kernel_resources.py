"""Registers, spills and shared memory of the Triton kernels this process compiled, as the GPU's
own Triton release reports them, with how many programs of each fit on one SM.

A CPU sm_90 compile (triton.compile on an ASTSource, then ptxas -v) is only as good as the
argument specialization it is given: on 2026-12-03 one stride of the decode split kernel
(128-token tile, 8 warps) compiled without the 16-divisibility hint put it at 255 registers with
spills, while the H200 compiled it to 91 without any (Triton 3.6 on CPU with every stride hinted:
92). Occupancy reasoning about a step (which programs can be resident beside which) should use
the device's numbers: lab.step_profile prints this table after each case.
"""
from __future__ import annotations

import importlib

from engine.kernels.common import programs_that_fit

# (module, JIT function) of the kernels of a decode / prefill step
ENGINE_KERNELS = (("engine.kernels.skinny_gemm", "_skinny_gemm_kernel"),
                  ("engine.kernels.slab_gemv", "_slab_gemv_kernel"),
                  ("engine.kernels.decode_attention", "_decode_split_kernel"),
                  ("engine.kernels.decode_attention", "_decode_reduce_kernel"),
                  ("engine.kernels.rmsnorm", "_rmsnorm_kernel"),
                  ("engine.kernels.rope_kv_write", "_rope_kv_write_kernel"),
                  ("engine.kernels.prefill_attention", "_prefill_kernel"))
# constexprs worth showing (the shape of a variant), when present
SHOWN = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "R", "SPLIT_K", "G_PAD", "USE_DOT", "NORM", "SILU",
         "RESID", "ROPE", "PDL", "ONE_CHUNK", "PREFETCH_X", "PREFETCH", "DIRECT", "NEXT_NORM", "TRACE")


def _constants(kernel, arg_names) -> dict:
    """name -> value of a compiled kernel's constexprs (keys are names or (index,) tuples,
    depending on the Triton release)."""
    consts = getattr(getattr(kernel, "src", None), "constants", None) or {}
    out = {}
    for k, v in consts.items():
        if isinstance(k, tuple) and len(k) == 1 and isinstance(k[0], int) and k[0] < len(arg_names):
            out[arg_names[k[0]]] = v
        elif isinstance(k, str):
            out[k] = v
    return out


def rows_for(name: str, fn) -> list[dict]:
    """One row per compiled variant of the JIT function fn (launched at least once)."""
    rows = []
    arg_names = list(getattr(fn, "arg_names", []))
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in list(cache.values()):
            n_regs = getattr(kernel, "n_regs", None)
            if not n_regs:  # not loaded on a device (or the interpreter)
                continue
            md = getattr(kernel, "metadata", None)
            warps = int(getattr(md, "num_warps", 4))
            shared = int(getattr(md, "shared", 0) or 0)
            c = _constants(kernel, arg_names)
            shown = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in c.items()
                             if k in SHOWN)
            rows.append({"kernel": name, "variant": shown, "warps": warps,
                         "stages": getattr(md, "num_stages", None), "regs": int(n_regs),
                         "spills": int(getattr(kernel, "n_spills", 0) or 0), "shared": shared,
                         "fit_per_sm": programs_that_fit(int(n_regs), warps, shared)})
    return rows


def compiled_rows(kernels=ENGINE_KERNELS) -> list[dict]:
    out = []
    for mod_name, fn_name in kernels:
        fn = getattr(importlib.import_module(mod_name), fn_name, None)
        if fn is not None:
            out += rows_for(fn_name, fn)
    return out


COLUMNS = ["kernel", "variant", "warps", "stages", "regs", "spills", "shared", "fit_per_sm"]
