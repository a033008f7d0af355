/* The sampler's candidate window on the CPU: per row, its `window` largest logit / temperature
 * values with their token ids (descending; ties by lower id) and the row's logsumexp.
 *
 * Why C: in torch the same takes a float32 copy and a division of the [rows, vocab] logits, a topk
 * and a logsumexp (five passes and two full-size temporaries), which at a decode step's rows of a
 * 49,152-token vocabulary costs a visible share of the step; here each row is read three times
 * (its max; its sum of exp, counting how many values lie within each of a few cuts below the max;
 * a vectorized collection of the values above the nearest cut that holds `window` of them) with no
 * temporary beyond one row's scratch.
 *
 * The window's values are computed as torch computes logits / temperature (the float32 of the bf16
 * or float32 logit, divided in float32), so it holds the numbers the torch path would; the
 * logsumexp multiplies by 1 / temperature instead (it may differ from torch's in the last bits).
 * The candidates are sorted (value descending, then id). Built at first use by
 * batchgen/engine/kernels/loader.py like the other csrc/ files.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */

#include "sample_rows.h"  /* load_one, load16, candidate keys, select_first, sort_keys, collect */

/* candidate cuts, in nats (after temperature) below the row's max: the collection takes the first
 * that holds at least `window` values, counted during the sum-of-exp pass so only one collection
 * pass reads the row again. Steps of about sqrt(2) keep the candidates at most about twice what the
 * window needs (the quickselect's work); past the last, everything is a candidate. */
#define NUM_CUTS 11
static const float CUT_NATS[NUM_CUTS] = {2.f, 3.f, 4.f, 6.f, 8.f, 11.f, 16.f, 22.f, 32.f, 45.f, 64.f};

/* the row's max logit, sum of exp((logit - max) / temperature), and how many logits lie within
 * each CUT_NATS[c] * temperature of the max */
static void max_and_sum(const void* x, int bf16, int64_t n, float temperature, float* out_max, float* out_sum,
                        int64_t* within) {
    const float inv_temperature = 1.f / temperature;
    int64_t i = 0;
    float m = -INFINITY, s = 0.f;
    for (int c = 0; c < NUM_CUTS; c++) within[c] = 0;
#ifdef __AVX512F__
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, load16(x, bf16, i, ALL16));
    m = _mm512_reduce_max_ps(vmax);
    for (int64_t j = i; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    __m512 acc = _mm512_setzero_ps();
    __m512 vcut[NUM_CUTS];
    for (int c = 0; c < NUM_CUTS; c++) vcut[c] = _mm512_set1_ps(m - CUT_NATS[c] * temperature);
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_temperature);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i, ALL16);
        /* most of a peaked row lies below the farthest cut, where exp(-64) and less cannot change a
         * float32 sum that holds the max's exp(0) = 1: one compare skips their exp and counts */
        if (!_mm512_cmp_ps_mask(v, vcut[NUM_CUTS - 1], _CMP_GE_OQ)) continue;
        acc = _mm512_add_ps(acc, exp16(_mm512_mul_ps(_mm512_sub_ps(v, vm), vt)));
        for (int c = 0; c < NUM_CUTS; c++)
            within[c] += __builtin_popcount(_mm512_cmp_ps_mask(v, vcut[c], _CMP_GE_OQ));
    }
    s = _mm512_reduce_add_ps(acc);
#else
    for (int64_t j = 0; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    i = 0;
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i);
        s += expf((v - m) * inv_temperature);
        for (int c = 0; c < NUM_CUTS; c++) within[c] += v >= m - CUT_NATS[c] * temperature;
    }
    *out_max = m;
    *out_sum = s;
}

static void window_row(const void* x, int bf16, int64_t n, float temperature, int64_t window, float* vals,
                       int64_t* ids, float* lse, float* raw, int32_t* raw_ids, uint64_t* scratch) {
    float m, s;
    int64_t within[NUM_CUTS];
    max_and_sum(x, bf16, n, temperature, &m, &s, within);
    *lse = m / temperature + logf(s);
    /* the nearest cut that holds the window (its values are the window's whatever the cut, as long as
     * it holds them all); none: everything is a candidate */
    float cut = -INFINITY;
    for (int c = 0; c < NUM_CUTS; c++)
        if (within[c] >= window) {
            cut = m - CUT_NATS[c] * temperature;
            break;
        }
    const int64_t k = collect(x, bf16, n, cut, raw, raw_ids);
    for (int64_t j = 0; j < k; j++)
        scratch[j] = candidate_key(raw[j] / temperature, raw_ids[j]);  /* as torch's logits / temperature */
    if (k > window) select_first(scratch, k, window);  /* the window's members first, in any order */
    const int64_t kept = k < window ? k : window;
    sort_keys(scratch, kept);
    for (int64_t j = 0; j < window; j++) {
        vals[j] = j < kept ? key_value(scratch[j]) : -INFINITY;
        ids[j] = j < kept ? (int64_t)(uint32_t)scratch[j] : 0;
    }
}

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16;
 * temperature: [rows]; out: vals [rows, window] float32, ids [rows, window] int64, lse [rows]. */
void sample_window(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   const float* temperature, int64_t window, float* vals, int64_t* ids, float* lse, int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel num_threads(num_threads)
    {
        /* one row's candidates at most: their logits and ids, then their keys to sort */
        float* raw = (float*)malloc((size_t)cols * sizeof(float));
        int32_t* raw_ids = (int32_t*)malloc((size_t)cols * sizeof(int32_t));
        uint64_t* scratch = (uint64_t*)malloc((size_t)cols * sizeof(uint64_t));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            window_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols, temperature[r], window,
                       vals + r * window, ids + r * window, lse + r, raw, raw_ids, scratch);
        free(scratch);
        free(raw_ids);
        free(raw);
    }
}
