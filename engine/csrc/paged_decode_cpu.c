/* Paged decode attention on CPU (fp32 queries; fp32 or bf16 cache), built at first use by
 * engine/cpu_native.py and called through ctypes.
 *
 * One query token per sequence attends over its cached context where it lies in the paged
 * cache ([num_blocks, block_size, num_kv_heads, head_dim] for K and for V): no gathered copy,
 * one pass with an online softmax, the query heads of one kv head (grouped-query attention)
 * sharing each K / V row they read. Work items are (sequence, kv head) pairs, spread over the
 * OpenMP threads of the runtime torch already loaded (same libgomp soname: one thread pool).
 */
#include "cpu_common.h"
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* flush denormals to zero inside the kernel (restored on return): a softmax weight near e^-87
 * times a small V value is denormal, and denormal arithmetic ran the step 4x slower */
#define FTZ_ON() unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040)
#define FTZ_OFF() _mm_setcsr(csr_)
#else
#define FTZ_ON() do {} while (0)
#define FTZ_OFF() do {} while (0)
#endif

#define MAX_HQ 64 /* query heads in one work item (and per kv head) */
#define MAX_D 256
#define MAX_BS 256
/* the running max before any score: finite, so the build may assume finite math; its
 * correction factor fast_exp(NO_MAX - s) is 0 */
#define NO_MAX (-1e30f)

static inline const float *row_f32(const void *base, int64_t off, int bf16, float *tmp, int d) {
    if (!bf16)
        return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
#pragma omp simd
    for (int i = 0; i < d; i++) {
        uint32_t b = (uint32_t)src[i] << 16;
        memcpy(&tmp[i], &b, sizeof b);
    }
    return tmp;
}

/* One work item: sequence i, kv heads [h0, h0 + nh), all of their query heads. Reads each
 * block's token rows in address order (K, then V). Software prefetch of the next block measured
 * slower in the engine (python -m bench.cpu_step). */
static void item(const float *q, int64_t q_seq_stride, int64_t q_head_stride, int64_t row,
                 const void *k_cache, const void *v_cache, int bf16, const int32_t *bt, int len,
                 float *out, int64_t out_seq_stride, int64_t out_head_stride, int h0, int nh,
                 int g_n, int hkv, int d, int bs, float scale) {
    const int nq = nh * g_n; /* query heads of this item: h0 * g_n .. */
    float qv[MAX_HQ * MAX_D], acc[MAX_HQ * MAX_D], sc[MAX_HQ * MAX_BS];
    float kt[MAX_D], vt[MAX_D], m[MAX_HQ], l[MAX_HQ];
    const int64_t tok_stride = (int64_t)hkv * d;
    for (int j = 0; j < nq; j++) {
        const float *qs = q + row * q_seq_stride + (int64_t)(h0 * g_n + j) * q_head_stride;
        for (int c = 0; c < d; c++) {
            qv[j * d + c] = qs[c] * scale;
            acc[j * d + c] = 0.0f;
        }
        m[j] = NO_MAX;
        l[j] = 0.0f;
    }
    for (int start = 0; start < len; start += bs) {
        const int cnt = len - start < bs ? len - start : bs;
        const int64_t base = (int64_t)bt[start / bs] * bs * tok_stride + (int64_t)h0 * d;
        for (int t = 0; t < cnt; t++) {
            for (int hh = 0; hh < nh; hh++) {
                const float *kr = row_f32(k_cache, base + t * tok_stride + hh * d, bf16, kt, d);
                for (int g = 0; g < g_n; g++) {
                    const float *qg = qv + (hh * g_n + g) * d;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int c = 0; c < d; c++)
                        s += qg[c] * kr[c];
                    sc[(hh * g_n + g) * MAX_BS + t] = s;
                }
            }
        }
        for (int j = 0; j < nq; j++) {
            float *sj = sc + j * MAX_BS;
            float mx = m[j];
            for (int t = 0; t < cnt; t++)
                mx = sj[t] > mx ? sj[t] : mx;
            const float corr = fast_exp(m[j] - mx); /* 0 while m[j] is NO_MAX */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < cnt; t++) {
                const float p = fast_exp(sj[t] - mx);
                sj[t] = p;
                sum += p;
            }
            l[j] = l[j] * corr + sum;
            m[j] = mx;
            float *aj = acc + j * d;
#pragma omp simd
            for (int c = 0; c < d; c++)
                aj[c] *= corr;
        }
        for (int t = 0; t < cnt; t++) {
            for (int hh = 0; hh < nh; hh++) {
                const float *vr = row_f32(v_cache, base + t * tok_stride + hh * d, bf16, vt, d);
                for (int g = 0; g < g_n; g++) {
                    const int j = hh * g_n + g;
                    const float p = sc[j * MAX_BS + t];
                    float *aj = acc + j * d;
#pragma omp simd
                    for (int c = 0; c < d; c++)
                        aj[c] += p * vr[c];
                }
            }
        }
    }
    for (int j = 0; j < nq; j++) {
        float *os = out + row * out_seq_stride + (int64_t)(h0 * g_n + j) * out_head_stride;
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        for (int c = 0; c < d; c++)
            os[c] = acc[j * d + c] * inv;
    }
}

/* q: the row of sequence i at q + q_rows[i] * q_seq_stride (q_rows NULL: row i), head h at
 * + h * q_head_stride; out at the same row. block_tables: int32 [n, bt_stride]; seq_lens:
 * int32 [n] (context length incl. this token). A sequence's kv heads are split into groups of
 * at most MAX_HQ query heads, and further while there are fewer items than 2 per thread.
 * Returns 0, or -1 for shapes beyond the limits. */
int splitserve_paged_decode(const float *q, int64_t q_seq_stride, int64_t q_head_stride,
                            const int64_t *q_rows, const void *k_cache, const void *v_cache,
                            int cache_bf16, const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *seq_lens, float *out, int64_t out_seq_stride,
                            int64_t out_head_stride, int n, int hq, int hkv, int d, int bs,
                            float scale, int nthreads) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_HQ || d > MAX_D || bs > MAX_BS || d <= 0 || bs <= 0)
        return -1;
    const int g_n = hq / hkv;
    int nh = hkv; /* kv heads an item covers */
    while (nh > 1 && (nh * g_n > MAX_HQ || (int64_t)n * ((hkv + nh - 1) / nh) < 2 * nthreads))
        nh = (nh + 1) / 2;
    const int per_seq = (hkv + nh - 1) / nh;
#pragma omp parallel num_threads(nthreads)
    {
        FTZ_ON();
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < n * per_seq; w++) {
            const int i = w / per_seq, h0 = (w % per_seq) * nh;
            const int cnt = hkv - h0 < nh ? hkv - h0 : nh;
            item(q, q_seq_stride, q_head_stride, q_rows ? q_rows[i] : i, k_cache, v_cache,
                 cache_bf16, block_tables + (int64_t)i * bt_stride, seq_lens[i], out,
                 out_seq_stride, out_head_stride, h0, cnt, g_n, hkv, d, bs, scale);
        }
        FTZ_OFF();
    }
    return 0;
}
