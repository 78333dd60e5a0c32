"""Fused fp32 elementwise ops for the CPU forward through the C kernels (engine/csrc/cpu_ops.c):
add + RMSNorm, SiLU-and-mul, rotary embedding of q and k in place. Each replaces 2-10 torch ops
(one pass over the rows, one call). The runner hands a CpuOps to the RMSNorm, SiluAndMul and
Attention modules of an fp32 model on CPU (their `cpu_ops`); the modules fall back to torch ops
for any other dtype or layout. Measure: python -m bench.cpu_step --variant
torch:cpu_kernels=torch --variant native:cpu_kernels=auto
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine import cpu_native

SRC = Path(cpu_native.__file__).parent / "csrc" / "cpu_ops.c"
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# below this many elements one thread does the pass (waking a second costs more than it saves)
ONE_THREAD_MAX = 16384


def _rows_ok(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.dim() >= 2 and t.stride(-1) == 1 for t in ts)


class CpuOps:
    def __init__(self, lib: ctypes.CDLL):
        self._norm = lib.splitserve_rms_norm
        self._norm.argtypes = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I32, _I32, _F, _I32]
        self._silu = lib.splitserve_silu_mul
        self._silu.argtypes = [_P, _I64, _P, _I64, _I32, _I32, _I32]
        self._rot = lib.splitserve_rotary
        self._rot.argtypes = [_P, _I64, _I64, _I32, _P, _I64, _I64, _I32, _P, _P, _I64, _I32, _I32, _I32]
        for f in (self._norm, self._silu, self._rot):
            f.restype = None

    @staticmethod
    def _threads(elements: int) -> int:
        return 1 if elements <= ONE_THREAD_MAX else torch.get_num_threads()

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float):
        """As RMSNorm.forward: norm(x), or (norm(x + residual), x + residual); None when the
        inputs are not fp32 rows [T, H] (the caller's torch ops then run)."""
        if not (_rows_ok(x) and x.dim() == 2 and weight.dtype == torch.float32 and weight.is_contiguous()
                and (residual is None or (_rows_ok(residual) and residual.shape == x.shape))):
            return None
        t, h = x.shape
        out = torch.empty((t, h), dtype=torch.float32)
        res_out = None if residual is None else torch.empty((t, h), dtype=torch.float32)
        self._norm(x.data_ptr(), x.stride(0),
                   None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                   None if res_out is None else res_out.data_ptr(), h,
                   weight.data_ptr(), out.data_ptr(), h, t, h, float(eps), self._threads(t * h))
        return out if residual is None else (out, res_out)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]; None for other dtypes / layouts."""
        if not (_rows_ok(x) and x.dim() == 2 and x.shape[1] % 2 == 0):
            return None
        t, i = x.shape[0], x.shape[1] // 2
        out = torch.empty((t, i), dtype=torch.float32)
        self._silu(x.data_ptr(), x.stride(0), out.data_ptr(), i, t, i, self._threads(t * i))
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotates q [T, Hq, D] and k [T, Hkv, D] in place by cos / sin [T, D/2]; False (nothing
        done) for other dtypes / layouts."""
        if not (_rows_ok(q, k, cos, sin) and q.dim() == 3 and k.dim() == 3 and cos.stride() == sin.stride()
                and q.stride(1) >= q.shape[2] and k.stride(1) >= k.shape[2]):
            return False
        t, hq, d = q.shape
        self._rot(q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0), k.stride(1),
                  k.shape[1], cos.data_ptr(), sin.data_ptr(), cos.stride(0), t, d,
                  self._threads(t * (hq + k.shape[1]) * d))
        return True


def make(mode: str) -> CpuOps | None:
    """mode auto: CpuOps when the kernels build here, else None; native: they must; torch: None."""
    lib = cpu_native.library(mode, SRC)
    return None if lib is None else CpuOps(lib)
