"""Small host lists to the device without stalling the host on the device's queue."""
from __future__ import annotations

import torch


def h2d(values, dtype: torch.dtype, device) -> torch.Tensor:
    """`values` (a list) as a tensor on `device`.
    NOTE: torch.tensor(values, device=cuda) is a blocking copy: the host waits for every kernel
    already queued (an overlapped step's included). Staged in pinned memory, the copy is queued
    behind them instead; torch's pinned-memory cache keeps the buffer until the copy ran."""
    t = torch.tensor(values, dtype=dtype)
    kind = torch.device(device).type
    if kind == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if kind == "cpu" else t.to(device)
