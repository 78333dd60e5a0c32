"""Triton skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M small (1..64).

At decode batch sizes the matmuls are weight-streaming problems: every weight byte is read
once per step and the arithmetic is nearly free, so the kernel's only job is to keep enough
bytes in flight to run at the memory roofline. cuBLAS reaches ~82% of the copy rate at M=1
on an H200 (measure: python -m lab.skinny_gemm_sweep); this kernel tiles over N with a K loop
whose loads the compiler pipelines, and optionally splits K (SPLIT_K programs per N tile)
when N / BLOCK_N alone cannot fill the GPU (the tensor-core path needs BLOCK_N >= 16, so a
4096-wide output has only 64-256 tiles). Split-K is deterministic: each split writes its fp32 partial sums
(and its partial sum of squares for NORM) to a workspace, then bumps the tile's arrival
counter; the LAST program to arrive sums the partials in split order 0..S-1 (whatever the
arrival order) and runs the epilogues, then resets the counter to 0 for the next launch.
So the result does not depend on scheduling (graph replay == eager, bit for bit) and the
epilogues below stay exact.

Fused prologue / epilogues (each optional), so one decoder layer needs 4 matmul launches
and no separate norm / activation / residual kernels:
  NORM:  x := rmsnorm(x) * norm_weight, folded in as  rstd[m] * sum_k W[n,k] (x[m,k] g[k]);
         the sum of squares accumulates in the same K loop (x is read anyway).
  SILU:  W is a fused [gate | up] weight of 2*N rows; y = silu(gate) * up       -> [M, N]
  RESID: y = y + residual[m, n]  (HF rounding: the matmul output rounds to the
         activation dtype first); `out` may alias `residual` (in-place residual stream:
         every element is read and written by the same program).
  BIAS:  y += bias[n] before the epilogues above.

next_norm (one row, no split-K, not cuBLAS or a slab): the LAST program to finish (a gpu-scope
arrival count, reset by that program) also writes rmsnorm(out) * g into a second buffer, the
next matmul's input norm rounded exactly like engine/kernels/rmsnorm.py, so the step needs no
rmsnorm kernel there (KernelOptions.fuse_next_norm: 8B o_proj -> gate_up). cut: launched
without the PDL attribute, so this kernel starts on an idle GPU once the previous one ended,
while it still lets the next kernel launch early.

At one row the tuned table may run the op as a slab GEMV instead (SkinnyConfig.slab;
engine/kernels/slab_gemv.py: a one-wave grid of programs, each streaming a contiguous slab
of whole rows, like a pure read). At 32+ rows the tuned table may run NORM as a separate
rmsnorm kernel instead (SkinnyConfig.norm_separate; HF's own rounding: normed x rounded to
the activation dtype).

Two inner products: USE_DOT (tensor cores, x padded to BLOCK_M >= 16 rows; the weight tile
goes through shared memory with cp.async / TMA pipelining) and the FMA path for a few rows
(weight tile straight to registers, fp32 products into a [BLOCK_M, BLOCK_N, BLOCK_K]
accumulator, one reduction over K after the loop; registers grow with BLOCK_M * BLOCK_N *
BLOCK_K, so it suits M <= 8 with small tiles). The FMA path can use BLOCK_N down to 1-4
rows, which gives the N=2048..4096 matmuls enough programs to fill the GPU without split-K;
the dot path cannot go below 16 rows.

ONE_CHUNK (set by the launcher when a program's K range fits one BLOCK_K chunk): no K loop,
so no accumulator is live across one. On sm_90 (ptxas -v, Triton 3.9) a one-row FMA tile of
a whole 4096-wide row drops from 128 to 98 registers (4 rows), 80 to 64 (2 rows), and with
norm + silu from 255 to 185 (4 rows): more programs, so more weight bytes in flight, per SM.
Such tiles (the sweep's one-row candidates with BLOCK_K = K) request every weight byte of a
program before the PDL wait, instead of a chain of K-loop round trips.

Neither a stream-K schedule nor an L2 prefetch window of the weights made these matmuls
faster on the H200 (lab/notes/kernels.md: the runs).

NOTE: rounding differs from the unfused torch sequence by ~1 bf16 ulp (the norm's scale is
applied after the dot product, not before it); the torch reference below is the oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import dot_precision, upcast_dots
from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_mode
from engine.kernels.skinny_configs import SkinnyConfig, default_config
from engine.kernels.skinny_gemm_parts import _epilogue, _load_w, _load_x, _mac, _next_norm
from engine.kernels.slab_gemv import runs as slab_runs
from engine.kernels.slab_gemv import slab_gemv
from engine.kernels import trace
from engine.kernels.trace import stamp, stamp_entry


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, bias_ptr, ws_ptr, ssq_ws_ptr,
                        lock_ptr, M, N, K, K_PER, up_off, stride_xm, stride_wn, stride_om,
                        stride_rm, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, PREFETCH_X: tl.constexpr, ONE_CHUNK: tl.constexpr,
                        NORM: tl.constexpr, SILU: tl.constexpr, RESID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                        EVEN_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                        PDL: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
                        nn_w_ptr, nn_out_ptr, nn_cnt_ptr, stride_nm, nn_eps, NEXT_NORM: tl.constexpr,
                        NN_BLOCK: tl.constexpr):
    if TRACE:  # engine/kernels/trace.py
        tpid = tl.program_id(0) * SPLIT_K + tl.program_id(1)
        stamp_entry(trace_ptr, tpid)
    if PDL == 1:
        # let the next kernel (launched with PDL) start its own weight prefetch now
        gdc_launch_dependents()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * K_PER  # K_PER: a multiple of BLOCK_K; every split has >= 1 chunk
    k_end = tl.minimum(K, k_start + K_PER)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k0 = k_start + tl.arange(0, BLOCK_K)
    # NOTE: int64 row offsets: lm_head is 128k x 4k elements (> 2^31 bytes)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + up_off.to(tl.int64) * stride_wn  # only read when SILU
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    ssq2 = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    # First K chunk peeled: its weights do not depend on the previous kernel, so they are
    # requested before the grid-dependency wait (with PDL this overlaps the previous
    # kernel's tail and the launch gap).
    # NOTE: nothing before gdc_wait may read activations or write anything: the previous
    # kernel may still be writing x / residual.
    w, wu = _load_w(w_rows, u_rows, offs_k0, n_mask, K, SILU, EVEN_K, EVEN_N)
    if PDL:
        gdc_wait()
    if TRACE:
        stamp(trace_ptr, tpid, 2, k_start)
    x = _load_x(x_rows, offs_k0, m_mask, K, EVEN_K)
    if PREFETCH_X:
        # register double buffering: chunk i+1's weights and x are requested before chunk
        # i's math (with NORM the x tile goes through registers (ssq, * g), so an
        # unprefetched x load puts its L2 latency on every iteration of the K loop)
        offs_cur = offs_k0
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w_next, wu_next = _load_w(w_rows, u_rows, offs_k, n_mask, K, SILU, EVEN_K, EVEN_N)
            x_next = _load_x(x_rows, offs_k, m_mask, K, EVEN_K)
            acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_cur, K,
                                    NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
            w = w_next
            wu = wu_next
            x = x_next
            offs_cur = offs_k
        acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_cur, K,
                                NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
    else:
        acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_k0, K,
                                NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
        if not ONE_CHUNK:
            # (ONE_CHUNK: the whole K range of this program is the peeled chunk: no loop, so
            # no accumulator stays live across one: fewer registers, more programs and more
            # bytes in flight per SM)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                w, wu = _load_w(w_rows, u_rows, offs_k, n_mask, K, SILU, EVEN_K, EVEN_N)
                x = _load_x(x_rows, offs_k, m_mask, K, EVEN_K)
                acc, acc_u, ssq2 = _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_k, K,
                                        NORM, SILU, USE_DOT, EVEN_K, PREC, UPCAST)
    if PDL == 2:  # late trigger (engine/kernels/pdl.py): every weight byte requested
        gdc_launch_dependents()
    if USE_DOT:
        y = acc
        y_u = acc_u
    else:
        y = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_N]
        y_u = tl.sum(acc_u, 2)
    ssq = tl.sum(ssq2, 1)
    adt: tl.constexpr = x_ptr.dtype.element_ty
    if SPLIT_K == 1:
        _epilogue(y, y_u, ssq, offs_m, offs_n, m_mask, n_mask, out_ptr, res_ptr, bias_ptr, K,
                  stride_om, stride_rm, eps, adt, NORM, SILU, RESID, HAS_BIAS)
    else:
        # workspace [SPLIT_K, (2 with SILU,) BLOCK_M, N] fp32; ssq workspace
        # [n_tiles, SPLIT_K, BLOCK_M]
        NH: tl.constexpr = 2 if SILU else 1
        tile = offs_m[:, None] * N + offs_n[None, :]
        part = ws_ptr + pid_k.to(tl.int64) * (NH * BLOCK_M) * N + tile
        st_mask = n_mask[None, :] & (offs_m < BLOCK_M)[:, None]
        tl.store(part, y, mask=st_mask)
        if SILU:
            tl.store(part + BLOCK_M * N, y_u, mask=st_mask)
        ssq_row = ssq_ws_ptr + pid * (SPLIT_K * BLOCK_M) + offs_m
        if NORM:
            tl.store(ssq_row + pid_k * BLOCK_M, ssq)
        # every thread's partial stores are ordered before the (single-thread) gpu-scope
        # release of the arrival count; the last arriver acquires, so it sees all partials
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(lock_ptr + pid, 0)  # ready for the next launch (graph replays included)
            y = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            y_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            ssq = tl.zeros([BLOCK_M], tl.float32)
            for s in range(SPLIT_K):  # fixed order: deterministic whatever the arrival order
                ps = ws_ptr + s * (NH * BLOCK_M) * N + tile
                # .cg: straight from L2 (other SMs wrote these; L1 is not coherent)
                y += tl.load(ps, mask=st_mask, other=0.0, cache_modifier=".cg")
                if SILU:
                    y_u += tl.load(ps + BLOCK_M * N, mask=st_mask, other=0.0, cache_modifier=".cg")
                if NORM:
                    ssq += tl.load(ssq_row + s * BLOCK_M, cache_modifier=".cg")
            _epilogue(y, y_u, ssq, offs_m, offs_n, m_mask, n_mask, out_ptr, res_ptr, bias_ptr,
                      K, stride_om, stride_rm, eps, adt, NORM, SILU, RESID, HAS_BIAS)
    if NEXT_NORM:  # SPLIT_K == 1 (the launcher checks): this program's rows are stored
        _next_norm(nn_cnt_ptr, out_ptr, nn_w_ptr, nn_out_ptr, M, N, stride_om, stride_nm, nn_eps,
                   NN_BLOCK, out_ptr.dtype.element_ty)
    if TRACE:
        stamp(trace_ptr, tpid, 5, k_end)


# The next-norm arrival count (skinny_linear's next_norm), one int32 per device; like the
# split-K counters, reset by its last arriver, allocated before any capture.
_NN_COUNT: dict[tuple[str, int | None], torch.Tensor] = {}
# next_norm's last arriver normalises every row alone: worth it only for a few rows
NEXT_NORM_MAX_M = 1


def _nn_count(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    buf = _NN_COUNT.get(key)
    if buf is None:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: the next-norm counter must be allocated before CUDA-graph "
                               "capture (run the batch once eagerly first, as the graph warm-up does)")
        buf = _NN_COUNT[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


def _fuses_next_norm(m: int, k: int, cfg: SkinnyConfig) -> bool:
    # the tile kernel without split-K (a slab entry at one row, cuBLAS: the rmsnorm kernel)
    return m <= NEXT_NORM_MAX_M and not cfg.cublas and not (cfg.slab and m == 1) and cfg.k_split(k)[0] == 1


def next_norm_fuses(m: int, n: int, k: int, device: torch.device, silu: bool = False,
                    kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether skinny_linear(next_norm=...) on an [m, k] x [n, k] matmul normalises its
    result in its own last program (else it runs the rmsnorm kernel after it)."""
    return _fuses_next_norm(m, k, default_config(m, n, k, torch.device(device), silu, kernels.skinny_table))


def norm_separate(m: int, n: int, k: int, device: torch.device, silu: bool = False,
                  kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether skinny_linear(norm_weight=...) runs the norm as a kernel of its own (the tuned
    config's norm_separate, or cuBLAS) rather than inside the matmul."""
    cfg = default_config(m, n, k, torch.device(device), silu, kernels.skinny_table)
    return cfg.cublas or cfg.norm_separate


# Split-K arrival counters, one int32 per N tile, per device. The last arriver resets its
# counter, so the buffer stays all-zero between launches and is shared by every split-K
# launch on the device. NOTE: this assumes split-K launches on one device do not run
# concurrently (true for the engine: one stream per process; PDL dependents only touch the
# counters after their grid-dependency wait, i.e. after the previous launch completed).
_LOCKS: dict[tuple[str, int | None], torch.Tensor] = {}


def _locks(device: torch.device, n_tiles: int) -> torch.Tensor:
    key = (device.type, device.index)
    buf = _LOCKS.get(key)
    if buf is None or buf.numel() < n_tiles:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: split-K counters must be allocated before CUDA-graph "
                               "capture (run the batch once eagerly first, as the graph warm-up does)")
        buf = torch.zeros(max(n_tiles, 16384), dtype=torch.int32, device=device)
        _LOCKS[key] = buf
    return buf


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu: bool = False,
                  residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, config: SkinnyConfig | None = None,
                  pdl: bool | None = None, cut: bool = False,
                  next_norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
                  kernels: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """x [M, K] (row stride free, unit column stride), weight [N_w, K] contiguous rows.
    Returns out [M, N] with N = N_w (or N_w / 2 with silu). See the module docstring for
    norm_weight / silu / residual / bias. out may be `residual` itself (in place).
    pdl: launch with programmatic dependent launch (None: where supported).
    cut: launch WITHOUT the PDL attribute (this kernel starts once the previous one ended, its
    programs spread over an idle GPU) while still letting the next kernel launch early.
    next_norm = (weight [N], eps, norm_out [M, N]): also write rmsnorm(out) * weight to
    norm_out (the next matmul's input norm, rounded like engine.kernels.rmsnorm), by the
    matmul's last program where next_norm_fuses says so, else by the rmsnorm kernel after it.
    kernels: the table (skinny_table), the PDL trigger and tracing of the launches."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K], [N, K]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a unit stride along K")
    M, K = x.shape
    NW = weight.shape[0]
    if silu and NW % 2:
        raise ValueError(f"silu needs a fused [gate | up] weight with an even row count, got {NW}")
    N = NW // 2 if silu else NW
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} != ({K},)")
    if bias is not None and bias.shape != (NW,):
        raise ValueError(f"bias {tuple(bias.shape)} != ({NW},)")
    if bias is not None and silu:
        raise ValueError("bias with silu is not supported")
    if residual is not None and (residual.shape != (M, N) or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} is not [{M}, {N}] with unit column stride")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} is not [{M}, {N}] with unit column stride")
    if next_norm is not None:
        nn_w, nn_eps, nn_out = next_norm
        if nn_w.shape != (N,) or nn_out.shape != (M, N) or nn_out.stride(1) != 1:
            raise ValueError(f"next_norm weight {tuple(nn_w.shape)} / out {tuple(nn_out.shape)} do not "
                             f"match the [{M}, {N}] result")
    if M == 0:
        return out
    cfg = config or default_config(M, N, K, x.device, silu, kernels.skinny_table)
    fuse_nn = next_norm is not None and _fuses_next_norm(M, K, cfg)
    if next_norm is not None and not fuse_nn:
        from engine.kernels.rmsnorm import rms_norm_into

        skinny_linear(x, weight, bias, norm_weight=norm_weight, eps=eps, silu=silu,
                      residual=residual, out=out, config=cfg, pdl=pdl, cut=cut, kernels=kernels)
        rms_norm_into(out, nn_w, nn_eps, nn_out, kernels)
        return out
    if cfg.cublas:
        return _cublas_linear(x, weight, bias, norm_weight, eps, silu, residual, out, kernels)
    if norm_weight is not None and cfg.norm_separate:
        from engine.kernels.rmsnorm import rms_norm

        x, norm_weight = rms_norm(x, norm_weight, eps, kernels), None
    if cfg.slab and slab_runs(M, weight):
        return slab_gemv(x, weight, out, rows_per_step=cfg.block_n, programs_per_sm=cfg.slab,
                         num_warps=cfg.num_warps, bias=bias, norm_weight=norm_weight, eps=eps,
                         silu=silu, residual=residual, pdl=pdl, cut=cut, kernels=kernels)
    bm = cfg.block_m(M)
    upcast = upcast_dots(x.dtype) or upcast_dots(weight.dtype)
    pdl = pdl_mode(x.device, pdl, kernels.pdl_late_trigger)
    launch = pdl_launch(pdl and not cut)
    n_tiles = triton.cdiv(N, cfg.block_n)
    splits, k_per = cfg.k_split(K)
    if splits > 1:
        ws = torch.empty((splits, 2 if silu else 1, bm, N), dtype=torch.float32, device=x.device)
        ssq_ws = (torch.empty((n_tiles, splits, bm), dtype=torch.float32, device=x.device)
                  if norm_weight is not None else ws)
        locks = _locks(x.device, n_tiles)
    else:
        ws = ssq_ws = locks = out
    nn_w, nn_out, nn_cnt = (next_norm[0], next_norm[2], _nn_count(x.device)) if fuse_nn else (out, out, out)
    tr, traced = trace.buffer("skinny_gemm", n_tiles * splits, x, kernels)
    _skinny_gemm_kernel[(n_tiles, splits)](
        x, weight, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, bias if bias is not None else x,
        ws, ssq_ws, locks, M, N, K, k_per, N, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else out.stride(0), float(eps),
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits,
        PREFETCH_X=cfg.prefetch_x and k_per > cfg.block_k, ONE_CHUNK=k_per <= cfg.block_k,
        NORM=norm_weight is not None, SILU=silu, RESID=residual is not None,
        HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot, EVEN_K=K % cfg.block_k == 0,
        EVEN_N=N % cfg.block_n == 0,
        PREC=dot_precision(torch.float32 if upcast else weight.dtype), UPCAST=upcast,
        PDL=pdl, trace_ptr=tr, TRACE=traced, nn_w_ptr=nn_w, nn_out_ptr=nn_out, nn_cnt_ptr=nn_cnt,
        stride_nm=nn_out.stride(0), nn_eps=float(next_norm[1]) if fuse_nn else 0.0, NEXT_NORM=fuse_nn, NN_BLOCK=triton.next_power_of_2(N) if fuse_nn else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
    return out


def _cublas_linear(x, weight, bias, norm_weight, eps, silu, residual, out, kernels):
    """The same op unfused: rmsnorm kernel, cuBLAS matmul, torch epilogues, each rounded to
    the activation dtype like HF (where the tuned table found cuBLAS faster for this op)."""
    if norm_weight is not None:
        from engine.kernels.rmsnorm import rms_norm

        x = rms_norm(x, norm_weight, eps, kernels)
    if not silu and residual is None and out.dtype == x.dtype == weight.dtype:
        # straight into `out`: F.linear + out.copy_ cost a device memcpy per call (a graph
        # memcpy node: 1.7 us per layer on the 8B 64-row qkv; measure: python -m lab.step_profile)
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    y = torch.nn.functional.linear(x, weight, bias)
    if silu:
        n = out.shape[1]
        if residual is None:
            return torch.mul(torch.nn.functional.silu(y[:, :n]), y[:, n:], out=out)
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    if residual is not None:
        return torch.add(y, residual, out=out)
    return out.copy_(y)  # (another output dtype)
