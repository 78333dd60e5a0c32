"""The decode rows' paged attention on CPU through the C kernel (engine/csrc/paged_decode_cpu.c):
each row reads its context in place from the cache, one pass, online softmax, the query heads of
a kv head sharing its K / V reads. The torch path (engine/layers/attention_cpu.py) gathers every
context into a padded copy first and multiplies Hkv x the score FLOPs; the C kernel does neither.
Measure: python -m bench.cpu_step --variant torch:cpu_kernels=torch --variant native:cpu_kernels=auto
"""
from __future__ import annotations

import ctypes

import torch

from engine import cpu_native

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class NativeDecode:
    """Callable over the built library; `supports` says which shapes and dtypes it takes."""

    MAX_HQ, MAX_D, MAX_BS = 64, 256, 256  # as in the C source

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.splitserve_paged_decode
        fn.restype = _I32
        fn.argtypes = [_P, _I64, _I64, _P, _P, _P, _I32, _P, _I64, _P, _P, _I64, _I64,
                       _I32, _I32, _I32, _I32, _I32, _F, _I32]
        self._fn = fn

    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        hq, d = q.shape[1], q.shape[2]
        bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
        return (q.dtype == torch.float32 and q.stride(2) == 1
                and kv_cache.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
                and hq % hkv == 0 and hq // hkv <= self.MAX_HQ and d <= self.MAX_D and bs <= self.MAX_BS)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                 q_rows: torch.Tensor | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> None:
        """q / out [T, Hq, D] fp32 (out written at the decode rows only); q_rows [n] int64 (None:
        rows 0..n-1); block_tables int32 [n, >= blocks] (rows may be strided); seq_lens int32 [n]."""
        n = seq_lens.shape[0]
        _, hq, d = q.shape
        bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
        assert out.stride(2) == 1 and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
        assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1),
                      None if q_rows is None else q_rows.data_ptr(),
                      kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                      int(kv_cache.dtype == torch.bfloat16),
                      block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                      out.data_ptr(), out.stride(0), out.stride(1),
                      n, hq, hkv, d, bs, float(scale), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"paged decode kernel refused the shape: Hq {hq}, Hkv {hkv}, D {d}, block {bs}")


def make(mode: str) -> NativeDecode | None:
    """mode auto: the C kernel when it builds here, else None (torch ops); native: it must build;
    torch: None."""
    lib = cpu_native.library(mode)
    return None if lib is None else NativeDecode(lib)
