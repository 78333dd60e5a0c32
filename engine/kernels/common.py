"""Small helpers shared by the Triton kernel wrappers.

NOTE: importing this module must not import triton: engine.models.llama imports it on every
machine (CPU included), and the test suite sets TRITON_INTERPRET only when it reaches the
kernel tests, after other modules were imported. Triton-level helpers live in
engine/kernels/pdl.py.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 8 on CPU (Triton interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs: exact fp32 products (tf32 would miss the reference tolerances);
    # bf16/fp16/fp8 operands: None = Triton's default (the setting only concerns fp32)
    return "ieee" if dtype == torch.float32 else None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dots(dtype: torch.dtype) -> bool:
    """NOTE: the Triton interpreter computes tl.dot on bf16 operands wrongly (raw bits), so
    under the interpreter bf16 kernels upcast their dot operands to fp32. Never on GPU."""
    return dtype == torch.bfloat16 and interpreting()


def programs_that_fit(n_regs: int, num_warps: int, shared_bytes: int = 0, regs_per_sm: int = 65536,
                      threads_per_sm: int = 2048, smem_per_sm: int = 228 * 1024,
                      blocks_per_sm: int = 32) -> int:
    """Resident programs per SM for a kernel using n_regs registers per thread (allocated per
    warp in units of 256) and shared_bytes of shared memory per program; at least 1."""
    warp_regs = -(-n_regs * 32 // 256) * 256
    fit = min(regs_per_sm // max(1, warp_regs * num_warps), threads_per_sm // (32 * num_warps),
              blocks_per_sm, smem_per_sm // shared_bytes if shared_bytes else blocks_per_sm)
    return max(1, fit)
