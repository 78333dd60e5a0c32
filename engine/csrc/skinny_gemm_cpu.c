/* fp32 y = x W^T (+ b) for a few rows x (decode: 1-8 rows), built at first use by
 * engine/cpu_native.py. Decode on CPU is bound by streaming the weights, so W is stored in the
 * order this loop reads it: tiles of 16 output columns, each [K][16] contiguous
 * (engine/layers/cpu_skinny.py packs it). A tile is one sequential stream; the M rows' 16
 * accumulators (two chains each, for FMA latency) stay in registers; tiles are split between
 * the OpenMP threads of torch's runtime.
 */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

#define KERNEL(M)                                                                              \
    static void tiles_##M(const float *x, int64_t xs, const float *w, const float *bias,       \
                          float *y, int64_t ys, int K, int N, int64_t t0, int64_t t1) {        \
        for (int64_t t = t0; t < t1; t++) {                                                    \
            v16 a0[M], a1[M];                                                                  \
            for (int m = 0; m < M; m++) {                                                      \
                a0[m] = (v16){0};                                                              \
                a1[m] = (v16){0};                                                              \
            }                                                                                  \
            const float *wt = w + t * (int64_t)K * 16;                                         \
            int k = 0;                                                                         \
            for (; k + 1 < K; k += 2) {                                                        \
                v16 w0, w1;                                                                    \
                memcpy(&w0, wt + (int64_t)k * 16, 64);                                         \
                memcpy(&w1, wt + (int64_t)k * 16 + 16, 64);                                    \
                for (int m = 0; m < M; m++) {                                                  \
                    a0[m] += x[m * xs + k] * w0;                                               \
                    a1[m] += x[m * xs + k + 1] * w1;                                           \
                }                                                                              \
            }                                                                                  \
            if (k < K) {                                                                       \
                v16 w0;                                                                        \
                memcpy(&w0, wt + (int64_t)k * 16, 64);                                         \
                for (int m = 0; m < M; m++)                                                    \
                    a0[m] += x[m * xs + k] * w0;                                               \
            }                                                                                  \
            const int64_t n0 = t * 16;                                                         \
            const int cnt = N - n0 < 16 ? (int)(N - n0) : 16;                                  \
            for (int m = 0; m < M; m++) {                                                      \
                v16 r = a0[m] + a1[m];                                                         \
                if (bias) {                                                                    \
                    v16 b = (v16){0};                                                          \
                    memcpy(&b, bias + n0, (size_t)cnt * 4);                                    \
                    r += b;                                                                    \
                }                                                                              \
                memcpy(y + m * ys + n0, &r, (size_t)cnt * 4);                                  \
            }                                                                                  \
        }                                                                                      \
    }

KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)
KERNEL(7)
KERNEL(8)

typedef void (*tiles_fn)(const float *, int64_t, const float *, const float *, float *, int64_t,
                         int, int, int64_t, int64_t);
static const tiles_fn TILES[9] = {0, tiles_1, tiles_2, tiles_3, tiles_4,
                                  tiles_5, tiles_6, tiles_7, tiles_8};

/* x [M, K] (row stride xs), w packed [ceil(N / 16), K, 16], bias [N] or NULL, y [M, N] (row
 * stride ys). Returns 0, or -1 for M outside 1..8. */
int splitserve_skinny_gemm(const float *x, int64_t xs, const float *w, const float *bias, float *y,
                           int64_t ys, int M, int K, int N, int nthreads) {
    if (M < 1 || M > 8)
        return -1;
    const int64_t tiles = (N + 15) / 16;
    const tiles_fn fn = TILES[M];
#pragma omp parallel num_threads(nthreads)
    {
        int id = 0, nt = 1;
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        id = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        fn(x, xs, w, bias, y, ys, K, N, tiles * id / nt, tiles * (id + 1) / nt);
    }
    return 0;
}
