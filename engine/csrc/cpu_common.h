/* Helpers the CPU kernels share (engine/csrc/*.c). The build cache key of every kernel covers
 * this header (engine/cpu_native.py): an edit here rebuilds them all. */
#ifndef SPLITSERVE_CPU_COMMON_H
#define SPLITSERVE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* [*t0, *t1) of n items for the calling thread of the current OpenMP parallel region */
static inline void thread_range(int64_t n, int64_t *t0, int64_t *t1) {
    int id = 0, nt = 1;
#ifdef _OPENMP
    extern int omp_get_thread_num(void), omp_get_num_threads(void);
    id = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    *t0 = n * id / nt;
    *t1 = n * (id + 1) / nt;
}

/* e^x, relative error ~1e-7 over [-87, 88] (clamped outside): 2^(x log2 e) split into an
 * integer power (exponent bits) and a fraction in [-0.5, 0.5] (Taylor series of 2^f to degree
 * 7). Plain arithmetic, so the loops that call it vectorize. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.4426950408889634f;
    float fi = floorf(t + 0.5f);
    float f = (t - fi) * 0.6931471805599453f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f
              + f * (8.3333338e-3f + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    int32_t e = ((int32_t)fi + 127) << 23;
    float s;
    memcpy(&s, &e, sizeof s);
    return p * s;
}

#endif
