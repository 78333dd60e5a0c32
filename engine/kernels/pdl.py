"""Programmatic dependent launch (Hopper+): Triton's grid-dependency primitives, imported
once for every kernel module, and the check whether a launch may use them.

A kernel launched with launch_pdl=True may start while the previous kernel still runs; it
must call gdc_wait() before reading anything that kernel writes (or writing anything), and
calls gdc_launch_dependents() to let the next kernel start early. Importing this module
imports triton (engine/kernels/common.py must not).
"""
from __future__ import annotations

import functools

import torch

from engine.kernels.common import interpreting

try:  # absent in old Triton releases: then pdl_supported() is False and no kernel calls them
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton release
    gdc_launch_dependents = gdc_wait = None


# Where a kernel lets its dependent launch (griddepcontrol.launch_dependents): at its start
# (mode 1) or after its main loads (mode 2, KernelOptions.pdl_late_trigger); either way the
# dependent reads nothing of this kernel's output before its gdc_wait (which waits for completion).


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


def pdl_mode(device: torch.device, pdl: bool | None = None, late: bool = False) -> int:
    """The kernels' PDL constexpr: 0 no PDL, 1 trigger the dependent at the start, 2 trigger
    it late (late: KernelOptions.pdl_late_trigger). pdl: force on / off (None: where
    pdl_supported)."""
    if pdl is None:
        pdl = pdl_supported(device)
    return (2 if late else 1) if pdl else 0


def pdl_launch(pdl) -> dict:
    """The launch keyword arguments for a kernel launched with PDL (mode or flag) or without."""
    return {"launch_pdl": True} if pdl else {}
