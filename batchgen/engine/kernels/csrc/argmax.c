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
#include "row_max.h"      /* row_max_allowed, lanes16 */

/* The first maximal index of row x[0, n) among the tokens words allows (all where words is NULL),
 * or of its first such NaN; 0 where none beats -inf, as torch's argmax of the row with -inf
 * written over the forbidden tokens. Inlined with words NULL, the plain argmax pays no mask. */
ALWAYS_INLINE int64_t argmax_row(const void* x, int bf16, int64_t n, const int32_t* words, int64_t num_words) {
    int any_nan;
    const float mx = row_max_allowed(x, bf16, n, words, num_words, &any_nan);
    if (!any_nan && mx == -INFINITY) return 0;
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes16(n, i, words, num_words);
        const __m512 v = load16(x, bf16, i, k);
        const __mmask16 hit = any_nan ? _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q)
                                      : _mm512_mask_cmp_ps_mask(k, v, m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;
}
#else
static int allowed(const int32_t* words, int64_t num_words, int64_t i) {
    return !words || (i / 32 < num_words && (((uint32_t)words[i / 32] >> (i % 32)) & 1u));
}

/* as above, one value at a time */
static int64_t argmax_row(const void* x, int bf16, int64_t n, const int32_t* words, int64_t num_words) {
    int64_t best = 0;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (!allowed(words, num_words, i)) continue;
        const float v = load_one(x, bf16, i);
        if (isnan(v)) return i;
        if (v > m) { m = v; best = i; }
    }
    return best;
}
#endif

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16.
 * out[r] = the first index of row r's maximum (of its first NaN, if any). */
void argmax_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out,
                 int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols, NULL, 0);
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
        out[r] = word_row[r] < 0 ? argmax_row(row, bf16, cols, NULL, 0)
                                 : argmax_row(row, bf16, cols, bitmask + word_row[r] * num_words, num_words);
    }
}
