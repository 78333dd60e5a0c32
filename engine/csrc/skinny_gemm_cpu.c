/* fp32 y = x W^T (+ b) for the few rows of a decode step (1-64), built at first use by
 * engine/cpu_native.py. W is stored in the order the loop reads it: tiles of 16 output columns,
 * each [K][16] contiguous (engine/layers/cpu_skinny.py packs it), read two at a time: two
 * sequential streams while few rows make the loop bound by the weights' bytes, and up to 12 rows
 * x 32 columns of accumulators in registers (24 of the 32 vector registers) where the FMAs bound
 * it. Tile pairs are split between the OpenMP threads of torch's runtime.
 */
#include "cpu_common.h"

typedef float v16 __attribute__((vector_size(64)));

/* rows per register block: 12 x 2 x 16 accumulators fill 24 of AVX-512's 32 registers; a
 * narrower ISA would spill them, so there the engine keeps oneDNN (splitserve_gemm_rows_block) */
#ifdef __AVX512F__
#define ROWS 12
#else
#define ROWS 2
#endif

int splitserve_gemm_rows_block(void) { return ROWS; }

/* R rows (R x 32 accumulators in registers) against one tile pair; the pair stays in L2 between
 * the blocks of 12 rows. */
#define KERNEL2(R)                                                                             \
    static void pair_##R(const float *x, int64_t xs, const float *w0p, const float *w1p,      \
                         float *acc0, float *acc1, int K) {                                    \
        v16 a[R], b[R];                                                                        \
        for (int m = 0; m < R; m++) {                                                          \
            a[m] = (v16){0};                                                                   \
            b[m] = (v16){0};                                                                   \
        }                                                                                      \
        for (int k = 0; k < K; k++) {                                                          \
            v16 w0, w1;                                                                        \
            memcpy(&w0, w0p + (int64_t)k * 16, 64);                                            \
            memcpy(&w1, w1p + (int64_t)k * 16, 64);                                            \
            for (int m = 0; m < R; m++) {                                                      \
                const float xv = x[m * xs + k];                                                \
                a[m] += xv * w0;                                                               \
                b[m] += xv * w1;                                                               \
            }                                                                                  \
        }                                                                                      \
        memcpy(acc0, a, sizeof a);                                                             \
        memcpy(acc1, b, sizeof b);                                                             \
    }

KERNEL2(1)
KERNEL2(2)
KERNEL2(3)
KERNEL2(4)
KERNEL2(5)
KERNEL2(6)
KERNEL2(7)
KERNEL2(8)
KERNEL2(9)
KERNEL2(10)
KERNEL2(11)
KERNEL2(12)

typedef void (*pair_fn)(const float *, int64_t, const float *, const float *, float *, float *, int);
static const pair_fn PAIRS[13] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6,
                                  pair_7, pair_8, pair_9, pair_10, pair_11, pair_12};

static void store(float *y, int64_t ys, const v16 *acc, int rows, const float *bias, int64_t n0,
                  int N) {
    const int cnt = N - n0 < 16 ? (int)(N - n0) : 16;
    if (cnt <= 0)
        return;
    v16 b = (v16){0};
    if (bias)
        memcpy(&b, bias + n0, (size_t)cnt * 4);
    for (int m = 0; m < rows; m++) {
        v16 r = acc[m] + b;
        memcpy(y + m * ys + n0, &r, (size_t)cnt * 4);
    }
}

/* x [M, K] (row stride xs), any M >= 1, w packed [2 * ceil(N / 32), K, 16] (tiles
 * are read in pairs), bias [N] or NULL, y [M, N] (row stride ys). */
int splitserve_gemm_rows(const float *x, int64_t xs, const float *w, const float *bias, float *y,
                         int64_t ys, int M, int K, int N, int nthreads) {
    if (M < 1)
        return -1;
    const int64_t pairs = (N + 31) / 32;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t p0, p1;
        thread_range(pairs, &p0, &p1);
        v16 acc0[12], acc1[12];
        for (int64_t p = p0; p < p1; p++) {
            const float *w0p = w + 2 * p * (int64_t)K * 16, *w1p = w0p + (int64_t)K * 16;
            for (int m0 = 0; m0 < M; m0 += ROWS) {
                const int r = M - m0 < ROWS ? M - m0 : ROWS;
                PAIRS[r](x + m0 * xs, xs, w0p, w1p, (float *)acc0, (float *)acc1, K);
                store(y + m0 * ys, ys, acc0, r, bias, 32 * p, N);
                store(y + m0 * ys, ys, acc1, r, bias, 32 * p + 16, N);
            }
        }
    }
    return 0;
}
