"""fp32 matmuls of 1-64 rows on CPU (the decode rows of a step) through the C kernel
(engine/csrc/skinny_gemm_cpu.c), which streams each weight in the order it reads it: tiles of
16 output columns, [K][16] contiguous. The runner packs every fp32 Linear and the LM head once
at load (a copy beside the oneDNN one, which serves larger steps) when the weights are at most
CPU_PACKED_MAX_BYTES: at 1-64 rows it ran faster than oneDNN's packed GEMM on the machines
measured. Measure: python -m bench.cpu_step --variant torch:cpu_kernels=torch
--variant native:cpu_kernels=auto
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine import cpu_native

SRC = Path(cpu_native.__file__).parent / "csrc" / "skinny_gemm_cpu.c"
MAX_ROWS = 64  # past this oneDNN's packed GEMM is as fast (prefill chunks)
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@torch.no_grad()
def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (any strides) -> [2 * ceil(N / 32), K, 16] contiguous, zero-padded columns
    (an even tile count: the many-row kernel reads tiles in pairs)."""
    n, k = w.shape
    tiles = 2 * -(-n // 32)
    wp = torch.zeros(tiles * 16, k, dtype=torch.float32)
    wp[:n] = w
    return wp.view(tiles, 16, k).transpose(1, 2).contiguous()


class SkinnyGemm:
    def __init__(self, lib: ctypes.CDLL):
        self.max_rows = MAX_ROWS
        self._fn = lib.splitserve_gemm_rows
        self._fn.restype = _I32
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32]

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [M, K] fp32 rows (M <= MAX_ROWS) -> [M, n]; None for inputs it does not take."""
        m = x.shape[0]
        if not (0 < m <= MAX_ROWS and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1):
            return None
        y = torch.empty((m, n), dtype=torch.float32)
        self._fn(x.data_ptr(), x.stride(0), packed.data_ptr(),
                 None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, x.shape[1], n,
                 torch.get_num_threads())
        return y


def make(mode: str) -> SkinnyGemm | None:
    """mode auto: the kernel when it builds here with AVX-512 (its register blocking needs 32
    vector registers), else None; native: it must build; torch: None."""
    lib = cpu_native.library(mode, SRC)
    if lib is None:
        return None
    if lib.splitserve_gemm_rows_block() < 12:  # no AVX-512 here: oneDNN's GEMM serves
        return None
    return SkinnyGemm(lib)
