/* The first pass over a row of float32 or bfloat16 logits, shared by argmax.c and target_logprob.c:
 * the row's maximum, and whether any value is NaN (a NaN decides both answers: argmax's index,
 * log_softmax's NaN); for argmax_rows_masked, over the tokens a grammar's bitmask allows.
 * Included under __AVX512F__. */
#ifndef BATCHGEN_ROW_MAX_H
#define BATCHGEN_ROW_MAX_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <immintrin.h>

#include "common.h"       /* ALWAYS_INLINE */
#include "simd_load16.h"  /* tail, load16 */

/* bits [i, i + 16) of a row's grammar bitmask words (i a multiple of 16): the tokens it allows;
 * none past its num_words */
ALWAYS_INLINE __mmask16 allowed16(const int32_t* words, int64_t num_words, int64_t i) {
    return i / 32 < num_words ? (__mmask16)((uint32_t)words[i / 32] >> (i & 16)) : (__mmask16)0;
}

/* the lanes of [i, i + 16) a pass reads: those below n, and where words is not NULL, those it allows */
ALWAYS_INLINE __mmask16 lanes16(int64_t n, int64_t i, const int32_t* words, int64_t num_words) {
    return words ? (__mmask16)(tail(n - i) & allowed16(words, num_words, i)) : tail(n - i);
}

/* the maximum of the values of x[0, n) that words allows (all of them where words is NULL; -inf
 * when none); *any_nan set to whether one of them is NaN */
ALWAYS_INLINE float row_max_allowed(const void* x, int bf16, int64_t n, const int32_t* words, int64_t num_words,
                                    int* any_nan) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes16(n, i, words, num_words);
        const __m512 v = load16(x, bf16, i, k);
        nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        vm = _mm512_mask_max_ps(vm, k, vm, v);
    }
    *any_nan = nan != 0;
    return _mm512_reduce_max_ps(vm);
}

/* the maximum of x[0, n) (-inf when n == 0); *any_nan set to whether a value is NaN */
ALWAYS_INLINE float row_max(const void* x, int bf16, int64_t n, int* any_nan) {
    return row_max_allowed(x, bf16, n, NULL, 0, any_nan);
}

#endif
