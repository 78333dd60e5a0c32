"""Timing shared by the benchmarks: the host clock around each call, CUDA events around each
call (host launch cost included) and CUDA-graph replay of a captured sequence of calls (launch
cost removed)."""
from __future__ import annotations

import statistics
import time

import torch


def host_time_s(fn, iters: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `iters` runs on the host clock (whatever fn waits for)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def l2_defeating_copies(nbytes: int, total: int = 512 << 20) -> int:
    """How many copies of an nbytes operand to cycle through so that together they exceed
    the L2 many times over (>= `total` bytes, at least 2): each timed call then reads from
    DRAM, as in a decode step."""
    return max(2, -(-total // nbytes))


def cuda_time_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median ms of fn() over `iters` runs, each bracketed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_time_ms(fns, iters: int = 15, warmup: int = 3) -> float:
    """Median ms per callable of `fns` (launched in order) captured as ONE CUDA graph and
    replayed. Each callable runs once on a side stream first: Triton compiles and the caching
    allocator grows outside the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    try:
        return cuda_time_ms(g.replay, iters=iters, warmup=warmup) / len(fns)
    finally:
        del g  # the graph's private memory goes back before the next case


def copy_bandwidth_gbs(nbytes: int = 1 << 30, device: str = "cuda", timer=cuda_time_ms) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read + written: the memory-bound
    ceiling the benchmarks' floors use. timer(fn, iters=...) -> median ms (a CPU smoke run
    passes its own)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = timer(lambda: y.copy_(x), iters=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9
