"""In-kernel timestamps, a diagnostic (off by default, and then compiled out).

With KernelOptions.trace set for a launch (or a CUDA-graph capture), the traced kernels (the
decode step's: slab GEMV, skinny GEMM, decode attention split and reduce, rmsnorm) write, per
program, the SM it ran on and %globaltimer (ns, one clock for all SMs) at fixed checkpoints
into a buffer allocated for that launch and appended to RECORDS:

    slot 0  SM id
    slot 1  entry (the program is resident; with PDL possibly before the previous kernel ends)
    slot 2  after the grid-dependency wait (== entry without PDL)
    slot 3  decode split only: rotary done, the new token's K/V written (else = entry)
    slot 4  decode split only: its K/V tiles attended (else = entry)
    slot 5  end (the program's last store issued)
    slots 6, 7  decode split with trace_probe only: its first tile's block ids loaded, then that
            tile's K and V loaded (a probe: loaded once more, timed on their own, before the
            attention loop reads them again, from cache; so the probe shortens the later phases)

python -m lab.step_profile --stamps replays a decode step captured with them and folds the stamps
into the per-layer pattern, relative to the previous kernel's last program end: how long a
kernel's wait is released after its predecessor ends, how long its own prologue takes,
how its programs' ends spread. That is what the CUPTI timeline (first program start, last
program end) cannot show.

A stamp is a store per program (every thread stores the same value); it costs a few
instructions per program, so traced steps run slower, and kernels of many short programs pay
most (a many-program tile's stamped time overstates its untraced time; measure the cost: python
-m lab.decode_ab --kernel-options-b trace=True). Compare phases of few-program kernels
(attention, slabs), not step totals or many-program tiles.
The Triton interpreter has no %globaltimer: tracing is GPU-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 8
_SLOTS = tl.constexpr(SLOTS)  # the same, for the kernels
# (kernel name, int64 [programs, SLOTS]) per traced launch, in launch order; only launches
# made while a CUDA graph is being captured are kept when CAPTURED_ONLY (a replay rewrites
# those buffers in place, so after one replay they hold that replay's stamps)
RECORDS: list[tuple[str, torch.Tensor]] = []
CAPTURED_ONLY = True


# Every traced launch of a capture gets its own slice of one arena allocated up front: a
# buffer from the allocator could reuse the memory of a tensor freed a moment ago (the
# attention's partial outputs, say) while the kernel that still uses it runs (PDL lets the
# next kernels start early, and the entry stamp is written before the grid-dependency wait),
# so the stamps and that kernel's data would overwrite each other. Launches outside a capture
# (warm-up, eager) share a scratch slice at the arena's start that is never read back.
ARENA_ROWS = 1 << 21  # [ARENA_ROWS, SLOTS] int64: 128 MiB, allocated at the first traced launch
SCRATCH_ROWS = 1 << 17
_arena: dict = {}


def _slice(device: torch.device, programs: int, keep: bool) -> torch.Tensor:
    key = (device.type, device.index)
    st = _arena.get(key)
    if st is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("trace: the arena must be allocated before a capture (trace a "
                               "warm-up launch first, as the graph runners do)")
        st = _arena[key] = [torch.empty((ARENA_ROWS, SLOTS), dtype=torch.int64, device=device),
                            SCRATCH_ROWS]
    arena, used = st
    if programs > SCRATCH_ROWS:
        raise RuntimeError(f"trace: {programs} programs exceed the scratch slice")
    if not keep:
        return arena[:programs]
    if used + programs > ARENA_ROWS:
        raise RuntimeError("trace: arena full (call trace.reset() between traced captures)")
    st[1] = used + programs
    return arena[used:used + programs]


def reset() -> None:
    """Forget the records; the arena's slices are handed out again from the start."""
    RECORDS.clear()
    for st in _arena.values():
        st[1] = SCRATCH_ROWS


def buffer(name: str, programs: int, like: torch.Tensor, kernels) -> tuple[torch.Tensor, int]:
    """(trace buffer, TRACE constexpr) for one launch: a [programs, SLOTS] int64 slice of the
    arena and 1 when kernels.trace (2 with kernels.trace_probe), else (like, 0) (a dummy
    pointer, never written)."""
    if not kernels.trace or like.device.type != "cuda":
        return like, 0
    keep = not CAPTURED_ONLY or torch.cuda.is_current_stream_capturing()
    buf = _slice(like.device, programs, keep)
    if keep:
        RECORDS.append((name, buf))
    return buf, 2 if kernels.trace_probe else 1


@triton.jit
def now(dep):
    """%globaltimer, read after `dep` (an int32 scalar) is available: the asm takes it as an
    operand, so the read cannot be hoisted above the work that produced it."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [dep],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def stamp(trace_ptr, pid, slot: tl.constexpr, dep):
    tl.store(trace_ptr + pid.to(tl.int64) * _SLOTS + slot, now(dep))


@triton.jit
def stamp_entry(trace_ptr, pid):
    """slots 0 (SM) and 1 (entry); slots 2-4 default to the entry (kernels overwrite them)."""
    t = now(pid)
    row = trace_ptr + pid.to(tl.int64) * _SLOTS
    tl.store(row, sm_id().to(tl.int64))
    tl.store(row + 1, t)
    tl.store(row + 2, t)
    tl.store(row + 3, t)
    tl.store(row + 4, t)
