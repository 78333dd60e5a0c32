"""Stream-K schedule for the skinny decode GEMM (engine/kernels/skinny_gemm.py).

The tile grid of skinny_gemm launches one program per N tile (times SPLIT_K). A decode
matmul has a few hundred to a few thousand tiles, and the tile count rarely divides the
GPU's program slots: 224 tiles of a gate_up weight on 132 SMs x 2 slots run as one partial
wave, 448 as 1.7 waves, and the last wave's SMs idle while the first's finish. Stream-K
launches a persistent grid of about programs_per_sm x SMs programs instead and hands each
an equal run of the (tile, K chunk) work units, laid out tile-major: a program finishes
the tail of one tile, then whole tiles, then starts the head of another. Every SM streams
the same number of weight bytes, whatever the tile count.

A tile covered by one program gets the epilogue straight away. A tile split between
programs is reduced like split-K (deterministic, so graph replay == eager bit for bit):
each contributor writes its fp32 partial (and its partial sum of squares for NORM) to the
slot given by its rank among the tile's contributors (known from the unit arithmetic),
bumps the tile's arrival counter, and the last to arrive sums the slots in rank order and
runs the epilogue, then resets the counter.

Same prologue / epilogues as the tile grid (NORM, SILU, RESID, BIAS) and the same inner
products (USE_DOT tensor cores or the FMA path); the helpers are shared.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import num_sms
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait
from engine.kernels.skinny_gemm_parts import _epilogue, _load_w, _load_x, _mac


@triton.jit
def _streamk_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, ws_ptr, ssq_ws_ptr,
                    lock_ptr, M, N, K, up_off, stride_xm, stride_wn, stride_om, stride_rm, eps,
                    n_units, CHUNKS, UPP,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MAX_SLOTS: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
                    RESID: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr, PDL: tl.constexpr):
    # CHUNKS: K chunks per tile; UPP: work units (tile, chunk) per program, every program
    # has at least one (the launcher sizes the grid so)
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    u = pid * UPP
    u_end = tl.minimum(u + UPP, n_units)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    adt: tl.constexpr = x_ptr.dtype.element_ty
    NH: tl.constexpr = 2 if SILU else 1
    # the first chunk's weights do not depend on the previous kernel: requested before the
    # grid-dependency wait (nothing before it may read activations or write anything)
    tile = u // CHUNKS
    c0 = u - tile * CHUNKS
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + up_off.to(tl.int64) * stride_wn
    w, wu = _load_w(w_rows, u_rows, c0 * BLOCK_K + tl.arange(0, BLOCK_K), n_mask, K, SILU,
                    EVEN_K, False)
    if PDL:
        gdc_wait()
    while u < u_end:
        # one segment: chunks c0..c1-1 of `tile`; w (wu) holds chunk c0's weights
        c1 = tl.minimum(CHUNKS, c0 + (u_end - u))
        offs_k0 = c0 * BLOCK_K + tl.arange(0, BLOCK_K)
        if USE_DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        ssq2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        x = _load_x(x_rows, offs_k0, m_mask, K, EVEN_K)
        acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_k0, K,
                                NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
        for c in range(c0 + 1, c1):
            offs_k = c * BLOCK_K + tl.arange(0, BLOCK_K)
            w, wu = _load_w(w_rows, u_rows, offs_k, n_mask, K, SILU, EVEN_K, EVEN_N)
            x = _load_x(x_rows, offs_k, m_mask, K, EVEN_K)
            acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_k, K,
                                    NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
        if USE_DOT:
            y = acc
            y_u = acc_u
        else:
            y = tl.sum(acc, 2)
            y_u = tl.sum(acc_u, 2)
        ssq = tl.sum(ssq2, 1)
        # the next segment (if any) starts at chunk 0 of the next tile: request its first
        # weights now, before this segment's epilogue (masked off past the program's end)
        u_next = u + (c1 - c0)
        offs_nn = (tile + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nn_mask = offs_nn < tl.where(u_next < u_end, N, 0)
        w_rows_n = w_ptr + offs_nn.to(tl.int64)[:, None] * stride_wn
        u_rows_n = w_rows_n + up_off.to(tl.int64) * stride_wn
        w_n, wu_n = _load_w(w_rows_n, u_rows_n, tl.arange(0, BLOCK_K), nn_mask, K, SILU, EVEN_K,
                            False)
        if (c0 == 0) & (c1 == CHUNKS):
            _epilogue(y, y_u, ssq, offs_m, offs_n, m_mask, n_mask, out_ptr, res_ptr, bias_ptr,
                      K, stride_om, stride_rm, eps, adt, NORM, SILU, RESID, HAS_BIAS)
        else:
            # contributors of this tile: programs first..last; our slot is our rank
            first = (tile * CHUNKS) // UPP
            count = ((tile + 1) * CHUNKS - 1) // UPP - first + 1
            tile_off = offs_m[:, None] * N + offs_n[None, :]
            part = ws_ptr + (pid - first).to(tl.int64) * (NH * BLOCK_M) * N + tile_off
            st_mask = n_mask[None, :] & (offs_m < BLOCK_M)[:, None]
            tl.store(part, y, mask=st_mask)
            if SILU:
                tl.store(part + BLOCK_M * N, y_u, mask=st_mask)
            ssq_row = ssq_ws_ptr + tile.to(tl.int64) * (MAX_SLOTS * BLOCK_M) + offs_m
            if NORM:
                tl.store(ssq_row + (pid - first) * BLOCK_M, ssq)
            # partial stores ordered before the gpu-scope release of the arrival count;
            # the last arriver acquires, so it sees every partial
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == count - 1:
                tl.store(lock_ptr + tile, 0)  # ready for the next launch
                y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                y_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                ssq = tl.zeros([BLOCK_M], tl.float32)
                for s in range(count):  # rank order: deterministic whatever the arrival order
                    ps = ws_ptr + s * (NH * BLOCK_M) * N + tile_off
                    # .cg: from L2 (other SMs wrote these; L1 is not coherent)
                    y += tl.load(ps, mask=st_mask, other=0.0, cache_modifier=".cg")
                    if SILU:
                        y_u += tl.load(ps + BLOCK_M * N, mask=st_mask, other=0.0,
                                       cache_modifier=".cg")
                    if NORM:
                        ssq += tl.load(ssq_row + s * BLOCK_M, cache_modifier=".cg")
                _epilogue(y, y_u, ssq, offs_m, offs_n, m_mask, n_mask, out_ptr, res_ptr,
                          bias_ptr, K, stride_om, stride_rm, eps, adt, NORM, SILU, RESID,
                          HAS_BIAS)
        u = u_next
        tile = tile + 1
        c0 = u_next - tile * CHUNKS  # 0 whenever the loop goes on (type-stable loop variable)
        offs_n = offs_nn
        n_mask = offs_nn < N
        w_rows = w_rows_n
        u_rows = u_rows_n
        w = w_n
        wu = wu_n


def streamk_plan(n_tiles: int, chunks: int, programs: int) -> tuple[int, int, int]:
    """(units per program, grid size, max contributors per tile) for n_tiles x chunks work
    units over about `programs` programs; every program gets at least one unit."""
    total = n_tiles * chunks
    upp = triton.cdiv(total, max(1, min(programs, total)))
    grid = triton.cdiv(total, upp)
    # a tile's chunks span at most ceil((chunks - 1) / upp) + 1 programs
    return upp, grid, triton.cdiv(chunks - 1, upp) + 1


def launch_streamk(x, weight, out, residual, norm_weight, bias, eps, silu, cfg, bm, upcast,
                   prec, pdl, locks_for):
    """Launches _streamk_kernel for skinny_linear (arguments already checked there)."""
    M, K = x.shape
    N = out.shape[1]
    n_tiles = triton.cdiv(N, cfg.block_n)
    chunks = triton.cdiv(K, cfg.block_k)
    upp, grid, max_slots = streamk_plan(n_tiles, chunks, cfg.programs_per_sm * num_sms(x.device))
    ws = torch.empty((max_slots, 2 if silu else 1, bm, N), dtype=torch.float32, device=x.device)
    ssq_ws = (torch.empty((n_tiles, max_slots, bm), dtype=torch.float32, device=x.device)
              if norm_weight is not None else ws)
    locks = locks_for(x.device, n_tiles)
    launch = {"launch_pdl": True} if pdl else {}
    _streamk_kernel[(grid,)](
        x, weight, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, bias if bias is not None else x,
        ws, ssq_ws, locks, M, N, K, N, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else out.stride(0), float(eps),
        n_tiles * chunks, chunks, upp,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MAX_SLOTS=max_slots,
        NORM=norm_weight is not None, SILU=silu, RESID=residual is not None,
        HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot, EVEN_K=K % cfg.block_k == 0,
        EVEN_N=N % cfg.block_n == 0, PREC=prec, UPCAST=upcast, PDL=bool(pdl), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch)
    return out
