"""L2 prefetch of a tensor the NEXT kernel will stream (Hopper bulk prefetch).

At small decode batches the attention kernels leave DRAM nearly idle for several µs per
layer (they read a few MB of KV and are latency-bound), while the o_proj matmul that follows
streams its whole weight (33.5 MB per layer for Llama-3.1-8B). A kernel given a prefetch
target issues `cp.async.bulk.prefetch.L2` for its share of that tensor before it waits on
the previous kernel (PDL): the reads overlap the attention instead of following it, and the
matmul then finds its weight in L2 (50 MB on an H100/H200).

The prefetch is a hint: it writes nothing and has no effect on results, so kernels compiled
without it (CPU interpreter, pre-Hopper GPUs) compute the same values. Importing this module
imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import pdl_supported

# one bulk prefetch per thread per program (4 warps): a share of 33.5 MB over 64 programs
# is 4 KB per instruction
PF_PIECES = tl.constexpr(128)


def bulk_prefetch_supported(device: torch.device) -> bool:
    """cp.async.bulk.prefetch needs sm_90+ (the same condition as PDL, not the interpreter)."""
    return pdl_supported(device)


def prefetch_span(t: torch.Tensor | None) -> int:
    """Elements of `t` the kernels may prefetch: 0 when t is None or not 16-byte aligned; the
    count is rounded down so the byte size is a multiple of 16 (the instruction's unit)."""
    if t is None or not t.is_cuda or t.data_ptr() % 16 or not t.is_contiguous():
        return 0
    per16 = max(1, 16 // t.element_size())
    return t.numel() // per16 * per16


@triton.jit
def l2_prefetch_share(ptr, numel, pid, nprog, PIECES: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    """Program pid of nprog issues L2 bulk prefetches for its contiguous share of
    ptr[0:numel] (numel * element size a multiple of 16 bytes, ptr 16-byte aligned), in
    PIECES pieces of whole 256-byte units. Non-blocking: nothing waits for the data.
    EVICT_LAST: the lines get the L2 evict-last policy (kept over streaming traffic)."""
    EB: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    UNIT: tl.constexpr = 256 // EB
    share = tl.cdiv(tl.cdiv(numel, nprog), UNIT * PIECES) * (UNIT * PIECES)
    piece = share // PIECES
    offs = pid.to(tl.int64) * share + tl.arange(0, PIECES).to(tl.int64) * piece
    nbytes = (tl.minimum(tl.maximum(numel - offs, 0), piece) * EB).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.u32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + tl.where(nbytes > 0, offs, 0), nbytes], dtype=tl.int32,
            is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + tl.where(nbytes > 0, offs, 0), nbytes], dtype=tl.int32,
            is_pure=False, pack=1)
