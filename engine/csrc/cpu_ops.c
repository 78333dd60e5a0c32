/* Fused fp32 elementwise ops of the CPU forward (engine/layers/cpu_ops.py), built at first use
 * by engine/cpu_native.py: each replaces several torch ops (one pass over the rows instead of
 * one per op, and one call instead of one dispatch per op). Rows are split over the OpenMP
 * threads of torch's runtime. Rows are addressed by a stride; the last dimension is contiguous.
 */
#include "cpu_common.h"

/* out = w * x / sqrt(mean(x^2) + eps) per row; with res (not NULL): x + res is normalized and
 * written to res_out first (the pre-norm residual stream). */
void splitserve_rms_norm(const float *x, int64_t xs, const float *res, int64_t rs, float *res_out,
                         int64_t ros, const float *w, float *out, int64_t os, int T, int H,
                         float eps, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t t0, t1;
        thread_range(T, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const float *xr = x + t * xs;
            float *o = out + t * os;
            if (res) {
                const float *rr = res + t * rs;
                float *ro = res_out + t * ros;
#pragma omp simd
                for (int i = 0; i < H; i++)
                    ro[i] = xr[i] + rr[i];
                xr = ro;
            }
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < H; i++)
                ss += xr[i] * xr[i];
            const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
            for (int i = 0; i < H; i++)
                o[i] = w[i] * (xr[i] * inv);
        }
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] (the gate and up halves of one row) */
void splitserve_silu_mul(const float *x, int64_t xs, float *out, int64_t os, int T, int I,
                         int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t t0, t1;
        thread_range(T, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const float *g = x + t * xs, *u = g + I;
            float *o = out + t * os;
#pragma omp simd
            for (int i = 0; i < I; i++)
                o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
        }
    }
}

/* In place: pairs (i, i + D/2) of every head of q [T, Hq, D] and k [T, Hkv, D] rotated by
 * cos / sin [T, D/2] (row strides qs / ks, head strides qh / kh). */
void splitserve_rotary(float *q, int64_t qs, int64_t qh, int hq, float *k, int64_t ks, int64_t kh,
                       int hkv, const float *cos_, const float *sin_, int64_t cs, int T, int D,
                       int nthreads) {
    const int half = D / 2;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t t0, t1;
        thread_range(T, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const float *c = cos_ + t * cs, *s = sin_ + t * cs;
            for (int h = 0; h < hq + hkv; h++) {
                float *x = h < hq ? q + t * qs + h * qh : k + t * ks + (h - hq) * kh;
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    const float a = x[i], b = x[i + half];
                    x[i] = a * c[i] - b * s[i];
                    x[i + half] = b * c[i] + a * s[i];
                }
            }
        }
    }
}
