"""Arrival counters for last-arriver reductions (split-K in the skinny GEMM, split merging
in decode attention): one int32 per reduction group, per device and per user. The last
program to arrive resets its counter, so a buffer stays all-zero between launches and is
reused by every launch, CUDA-graph replays included.

NOTE: assumes launches sharing a buffer do not run concurrently (one stream per process;
a kernel launched with PDL touches counters only after its grid-dependency wait, i.e.
after the previous kernel completed).
"""
from __future__ import annotations

import torch

_BUFS: dict[tuple[str, int | None, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, user: str, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for `user` on `device`; grown (never
    during CUDA-graph capture: run the shape eagerly first, as the graph warm-up does)."""
    device = torch.device(device)
    key = (device.type, device.index, user)
    buf = _BUFS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{user}: arrival counters must be allocated before CUDA-graph "
                               "capture (run the batch once eagerly first, as the graph warm-up does)")
        buf = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
        _BUFS[key] = buf
    return buf
