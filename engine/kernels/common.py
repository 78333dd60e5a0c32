"""Small helpers shared by the Triton kernel wrappers."""
from __future__ import annotations

import functools
import os

import torch

try:  # programmatic dependent launch primitives (Hopper+); absent in old Triton releases.
    # Kernels import them from here; they are only called under a PDL constexpr that
    # pdl_supported() sets, so a Triton without them never reaches the calls.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton release
    gdc_launch_dependents = gdc_wait = None


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


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton that has gdc_wait, not the
    interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or gdc_wait is None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(idx) >= (9, 0)
