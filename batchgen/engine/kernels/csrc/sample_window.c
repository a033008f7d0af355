/* The sampler's candidate window on the CPU: per row, its `window` largest logit / temperature
 * values with their token ids (descending; ties by lower id) and the row's logsumexp.
 *
 * Why C: in torch the same takes a float32 copy and a division of the [rows, vocab] logits, a topk
 * and a logsumexp (five passes and two full-size temporaries), which at a decode step's rows of a
 * 49,152-token vocabulary costs a visible share of the step; here each row is read four times
 * (its max, its sum of exp, a vectorized collection of the values above a cut, which moves down
 * until at least `window` are in) with no temporary beyond one row's scratch.
 *
 * The window's values are computed as torch computes logits / temperature (the float32 of the bf16
 * or float32 logit, divided in float32), so it holds the numbers the torch path would; the
 * logsumexp multiplies by 1 / temperature instead (it may differ from torch's in the last bits).
 * The candidates are sorted (value descending, then id). Built at first use by
 * batchgen/engine/kernels/native.py like the other csrc/ files.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_one(const void* x, int bf16, int64_t i) {
    if (!bf16) return ((const float*)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t*)x)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_exp.h"

ALWAYS_INLINE __m512 load16(const void* x, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float*)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

typedef struct { float value; int32_t id; } candidate;

static int by_value_desc(const void* a, const void* b) {
    const candidate* x = (const candidate*)a;
    const candidate* y = (const candidate*)b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return x->id - y->id;
}

ALWAYS_INLINE int before(const candidate* a, const candidate* b) {  /* by_value_desc's order */
    return a->value > b->value || (a->value == b->value && a->id < b->id);
}

/* quickselect: reorder c so that its first `count` entries are the first `count` in sorted order */
static void select_first(candidate* c, int64_t n, int64_t count) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const candidate pivot = c[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(&c[i], &pivot)) i++;
            while (before(&pivot, &c[j])) j--;
            if (i <= j) {
                const candidate t = c[i];
                c[i] = c[j];
                c[j] = t;
                i++;
                j--;
            }
        }
        if (count - 1 <= j) hi = j;
        else if (count - 1 >= i) lo = i;
        else break;
    }
}

/* the row's max logit and sum of exp((logit - max) / temperature) */
static void max_and_sum(const void* x, int bf16, int64_t n, float inv_temperature, float* out_max, float* out_sum) {
    int64_t i = 0;
    float m = -INFINITY, s = 0.f;
#ifdef __AVX512F__
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, load16(x, bf16, i));
    m = _mm512_reduce_max_ps(vmax);
    for (int64_t j = i; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    __m512 acc = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_temperature);
    for (i = 0; i + 16 <= n; i += 16)
        acc = _mm512_add_ps(acc, exp16(_mm512_mul_ps(_mm512_sub_ps(load16(x, bf16, i), vm), vt)));
    s = _mm512_reduce_add_ps(acc);
#else
    for (int64_t j = 0; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    i = 0;
#endif
    for (; i < n; i++) s += expf((load_one(x, bf16, i) - m) * inv_temperature);
    *out_max = m;
    *out_sum = s;
}

/* the row's logits >= cut and their ids into raw/ids (vectorized); returns how many */
static int64_t collect(const void* x, int bf16, int64_t n, float cut, float* raw, int32_t* ids) {
    int64_t k = 0, i = 0;
#ifdef __AVX512F__
    const __m512 vcut = _mm512_set1_ps(cut);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i);
        const __mmask16 keep = _mm512_cmp_ps_mask(v, vcut, _CMP_GE_OQ);
        if (!keep) continue;
        _mm512_mask_compressstoreu_ps(raw + k, keep, v);
        _mm512_mask_compressstoreu_epi32(ids + k, keep, _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota));
        k += __builtin_popcount(keep);
    }
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (v >= cut) { raw[k] = v; ids[k] = (int32_t)i; k++; }
    }
    return k;
}

static void window_row(const void* x, int bf16, int64_t n, float temperature, int64_t window, float* vals,
                       int64_t* ids, float* lse, float* raw, int32_t* raw_ids, candidate* scratch) {
    const float inv_temperature = 1.f / temperature;
    float m, s;
    max_and_sum(x, bf16, n, inv_temperature, &m, &s);
    *lse = m / temperature + logf(s);
    /* the cut starts 4 nats (after temperature) below the max and goes twice as far until the
     * window fills; past 64 nats everything is a candidate */
    float distance = 4.f * temperature;
    int64_t k;
    for (;;) {
        const float cut = distance > 64.f * temperature ? -INFINITY : m - distance;
        k = collect(x, bf16, n, cut, raw, raw_ids);
        if (k >= window || cut == -INFINITY) break;
        distance *= 2.f;
    }
    for (int64_t j = 0; j < k; j++) {
        scratch[j].value = raw[j] / temperature;  /* as torch's logits / temperature */
        scratch[j].id = raw_ids[j];
    }
    if (k > window) select_first(scratch, k, window);  /* the window's members first, in any order */
    qsort(scratch, (size_t)(k < window ? k : window), sizeof(candidate), by_value_desc);
    for (int64_t j = 0; j < window; j++) {
        vals[j] = j < k ? scratch[j].value : -INFINITY;
        ids[j] = j < k ? scratch[j].id : 0;
    }
}

/* x: [rows] rows of cols logits, row_stride elements apart; dtype 0 float32, 1 bfloat16;
 * temperature: [rows]; out: vals [rows, window] float32, ids [rows, window] int64, lse [rows]. */
void sample_window(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   const float* temperature, int64_t window, float* vals, int64_t* ids, float* lse, int num_threads) {
    const int elem = dtype == 1 ? 2 : 4;
    #pragma omp parallel num_threads(num_threads)
    {
        /* one row's candidates at most: their logits and ids, then the (value, id) pairs to sort */
        float* raw = (float*)malloc((size_t)cols * sizeof(float));
        int32_t* raw_ids = (int32_t*)malloc((size_t)cols * sizeof(int32_t));
        candidate* scratch = (candidate*)malloc((size_t)cols * sizeof(candidate));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            window_row((const char*)x + r * row_stride * elem, dtype == 1, cols, temperature[r], window,
                       vals + r * window, ids + r * window, lse + r, raw, raw_ids, scratch);
        free(scratch);
        free(raw_ids);
        free(raw);
    }
}
