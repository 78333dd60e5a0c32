"""Triton pieces of the skinny decode GEMM (engine/kernels/skinny_gemm.py, whose docstring
says what each does): weight / activation chunk loads, the multiply-accumulate of one K
chunk (with the fused norm prologue), and the epilogues."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(rows, offs_k, n_mask, K, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """[BLOCK_N, BLOCK_K] weight tile at K offsets offs_k, masked only where needed."""
    if EVEN_K:
        if EVEN_N:
            return tl.load(rows + offs_k[None, :])
        return tl.load(rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _load_w(w_rows, u_rows, offs_k, n_mask, K, SILU: tl.constexpr, EVEN_K: tl.constexpr,
            EVEN_N: tl.constexpr):
    """Weight tile(s) [BLOCK_N, BLOCK_K] for K offsets offs_k (the 'up' tile too with SILU)."""
    w = _load_tile(w_rows, offs_k, n_mask, K, EVEN_K, EVEN_N)
    wu = w
    if SILU:
        wu = _load_tile(u_rows, offs_k, n_mask, K, EVEN_K, EVEN_N)
    return w, wu


@triton.jit
def _load_x(x_rows, offs_k, m_mask, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    return tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _mac(acc, acc_u, ssq2, w, wu, x, nw_ptr, offs_k, K, NORM: tl.constexpr,
         SILU: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
         UPCAST: tl.constexpr):
    """One K chunk: x [BLOCK_M, BLOCK_K] (scaled by the norm weight with NORM); accumulate
    x . w^T (and x . wu^T)."""
    xf = x.to(tl.float32)
    if NORM:
        # NOTE: elementwise; reduced once after the K loop (a per-chunk tl.sum is a CTA-wide
        # reduction through shared memory with barriers, measured ~30% slower on the H200)
        ssq2 += xf * xf
        if EVEN_K:
            g = tl.load(nw_ptr + offs_k)
        else:
            g = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0)
        xf = xf * g.to(tl.float32)[None, :]
    if USE_DOT:
        if UPCAST:
            acc += tl.dot(xf, tl.trans(w.to(tl.float32)), input_precision=PREC)
            if SILU:
                acc_u += tl.dot(xf, tl.trans(wu.to(tl.float32)), input_precision=PREC)
        else:
            xd = xf.to(w.dtype)
            acc += tl.dot(xd, tl.trans(w), input_precision=PREC)
            if SILU:
                acc_u += tl.dot(xd, tl.trans(wu), input_precision=PREC)
    else:
        # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K]; reduced over K after the loop
        acc += w.to(tl.float32)[None, :, :] * xf[:, None, :]
        if SILU:
            acc_u += wu.to(tl.float32)[None, :, :] * xf[:, None, :]
    return acc, acc_u, ssq2


@triton.jit
def _epilogue(y, y_u, ssq, offs_m, offs_n, m_mask, n_mask, out_ptr, res_ptr, bias_ptr, K,
              stride_om, stride_rm, eps, x_dtype: tl.constexpr, NORM: tl.constexpr,
              SILU: tl.constexpr, RESID: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y, y_u [BLOCK_M, BLOCK_N] fp32 full dot products; ssq [BLOCK_M] sum of x^2 over K."""
    if NORM:
        rstd = tl.rsqrt(ssq / K + eps)
        y = y * rstd[:, None]
        y_u = y_u * rstd[:, None]
    if HAS_BIAS:
        y = (y + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :])
    if SILU:  # HF rounds each op's output to the activation dtype
        gate = y.to(x_dtype).to(tl.float32)
        up = y_u.to(x_dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_dtype).to(tl.float32)
        y = act * up
    out_mask = m_mask[:, None] & n_mask[None, :]
    if RESID:
        r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                    mask=out_mask, other=0.0)
        y = y.to(x_dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _next_norm(cnt_ptr, y_ptr, w_ptr, out_ptr, M, N, stride_ym, stride_om, eps,
               BLOCK: tl.constexpr, adt: tl.constexpr):
    """Called by every program after its last store of y: the LAST program to arrive
    (a gpu-scope arrival count) normalises the finished rows y[:M, :N] into out, rounded
    like engine.kernels.rmsnorm (HF: (x * rstd) to the dtype, times the weight, to the
    dtype), and resets the count for the next launch. So the next matmul's input norm needs
    no kernel of its own (skinny_linear's next_norm)."""
    # every thread's stores of y are ordered before the (single-thread) gpu-scope release of
    # the count; the last arriver acquires, so it sees all programs' rows
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(cnt_ptr, 0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for m in range(M):
            # .cg: straight from L2 (other SMs wrote these rows; L1 is not coherent)
            x = tl.load(y_ptr + m * stride_ym + offs, mask=mask, other=0.0, cache_modifier=".cg")
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
            yv = (xf * rstd).to(adt).to(tl.float32)
            tl.store(out_ptr + m * stride_om + offs, (g * yv).to(adt), mask=mask)
