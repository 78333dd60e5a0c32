"""L2 prefetch of the weight the next kernel reads, issued by a kernel that leaves DRAM idle.

At batch 1 the decode step is a weight stream, and DRAM idles whenever a latency-bound kernel
runs: decode attention at small batch reads a few MB of KV in ~9 us per layer (8B shape, H200
timeline, step_profile-20261203T122600), against the o_proj weight (32 MiB) that follows it.
A kernel given `prefetch_l2` requests such a byte range into L2 (`prefetch.global.L2`, one
128-byte line per lane per round, fire and forget: no register waits for it, nothing is
written), split evenly over its programs, so the next kernel reads from L2.

A prefetch reads only constant data (weights), so it may run before a kernel's PDL wait.
The interpreter has no inline PTX: launchers pass no prefetch there (`prefetch_view`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreting

LINE = 128  # bytes per prefetch (an L2 line)


@triton.jit
def prefetch_l2(base_ptr, nbytes, pid, nprog, CHUNK: tl.constexpr):
    """Program pid of nprog requests its share of bytes [base_ptr, base_ptr + nbytes) into L2.
    base_ptr: a uint8 pointer (prefetch_view)."""
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, nprog)
    first = pid * per
    last = tl.minimum(first + per, lines)
    token = tl.zeros([CHUNK], tl.int32)
    for i in range(first, last, CHUNK):
        # past `last` a lane repeats the share's last line (a duplicate prefetch is free)
        ln = tl.minimum(i + tl.arange(0, CHUNK), last - 1)
        token += tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                           [base_ptr + ln.to(tl.int64) * 128], dtype=tl.int32,
                                           is_pure=False, pack=1)
    # NOTE: the asm's output (always 0) feeds a store that never happens, which the compiler
    # cannot prove: without a use Triton 3.6 deletes the loop as dead code (3.9 keeps it), and
    # a use inside the caller's math (an index + a reduced token) cost 3.9 registers
    tl.store(base_ptr + tl.arange(0, CHUNK), token.to(tl.uint8), mask=token != 0)


def prefetch_view(t: torch.Tensor | None, max_bytes: int) -> tuple[torch.Tensor | None, int]:
    """(t's bytes as a flat uint8 tensor, how many of them to prefetch: at most max_bytes from
    the start), or (None, 0) where nothing is prefetched: no tensor, a CPU tensor, the
    interpreter, a non-contiguous tensor or max_bytes <= 0."""
    if t is None or max_bytes <= 0 or t.device.type != "cuda" or interpreting() or not t.is_contiguous():
        return None, 0
    flat = t.view(-1).view(torch.uint8)
    return flat, min(flat.numel(), int(max_bytes))
