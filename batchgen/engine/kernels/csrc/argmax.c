/* Greedy sampling's argmax over the step's logits rows on the CPU.
 *
 * Why C: torch's max(dim=-1) on bf16 logits runs well below memory speed, and at a decode step's
 * 128 rows of a 49,152-token vocabulary it is a visible share of the step; two vector passes over
 * each row (its max, then the first index holding it) run at memory speed.
 *
 * Same result as torch.argmax / max(dim).indices: the first index of the maximum, and a NaN
 * counts as the maximum (the first NaN's index), so greedy output equals model.generate's.
 * argmax_rows_masked is structured output's greedy pick: the same answer as the argmax of a copy
 * of the logits with -inf written over each constrained row's forbidden tokens (token_bitmask.c),
 * read from the grammar's bitmask as it scans, so the step neither copies nor writes the logits.
 * Built at first use by batchgen/engine/kernels/loader.py like the other csrc/ files.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */

#include "bf16_convert.h"  /* load_one */

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_load16.h"  /* tail, load16 */
#include "row_max.h"      /* row_max */

static int64_t argmax_row(const void* x, int bf16, int64_t n) {
    int any_nan;
    const float mx = row_max(x, bf16, n, &any_nan);
    if (any_nan) {
        for (int64_t i = 0; i < n; i++)
            if (isnan(load_one(x, bf16, i))) return i;
    }
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, load16(x, bf16, i, k), m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;  /* n == 0, or every value -inf: index 0 is torch's answer too */
}

/* bits [i, i + 16) of a row's bitmask words (i a multiple of 16); none past its num_words */
ALWAYS_INLINE __mmask16 allowed16(const int32_t* words, int64_t num_words, int64_t i) {
    return i / 32 < num_words ? (__mmask16)((uint32_t)words[i / 32] >> (i & 16)) : (__mmask16)0;
}

static int64_t argmax_row_masked(const void* x, int bf16, int64_t n, const int32_t* words, int64_t num_words) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 any_nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i) & allowed16(words, num_words, i);
        const __m512 v = load16(x, bf16, i, k);
        any_nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        vm = _mm512_mask_max_ps(vm, k, vm, v);
    }
    if (any_nan) {
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 k = tail(n - i) & allowed16(words, num_words, i);
            const __m512 v = load16(x, bf16, i, k);
            const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
            if (hit) return i + __builtin_ctz(hit);
        }
    }
    const float best = _mm512_reduce_max_ps(vm);
    if (best == -INFINITY) return 0;  /* the masked copy is all -inf: its argmax is index 0 */
    const __m512 m = _mm512_set1_ps(best);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i) & allowed16(words, num_words, i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, load16(x, bf16, i, k), m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}
#else
static int64_t argmax_row(const void* x, int bf16, int64_t n) {
    int64_t best = 0;
    float m = n ? load_one(x, bf16, 0) : 0.f;
    if (isnan(m)) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (isnan(v)) return i;
        if (v > m) { m = v; best = i; }
    }
    return best;
}

static int allowed(const int32_t* words, int64_t num_words, int64_t i) {
    return i / 32 < num_words && (((uint32_t)words[i / 32] >> (i % 32)) & 1u);
}

static int64_t argmax_row_masked(const void* x, int bf16, int64_t n, const int32_t* words, int64_t num_words) {
    int64_t best = 0;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (!allowed(words, num_words, i)) continue;
        const float v = load_one(x, bf16, i);
        if (isnan(v)) return i;
        if (v > m) { m = v; best = i; }
    }
    return best;  /* 0 where no allowed token beats -inf, as the masked copy's argmax */
}
#endif

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16.
 * out[r] = the first index of row r's maximum (of its first NaN, if any). */
void argmax_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out,
                 int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols);
}

/* argmax_rows where row r with word_row[r] >= 0 may pick only the tokens whose bits are set in
 * bitmask row word_row[r] (num_words int32 words, bit t % 32 of word t / 32; tokens past them are
 * forbidden); a row with word_row[r] < 0 is unconstrained. */
void argmax_rows_masked(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride,
                        const int32_t* bitmask, int64_t num_words, const int64_t* word_row, int64_t* out,
                        int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const int bf16 = dtype == DTYPE_BF16;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void* row = (const char*)x + r * row_stride * elem;
        out[r] = word_row[r] < 0 ? argmax_row(row, bf16, cols)
                                 : argmax_row_masked(row, bf16, cols, bitmask + word_row[r] * num_words, num_words);
    }
}
