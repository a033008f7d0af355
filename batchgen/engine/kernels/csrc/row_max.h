/* The first pass over a row of float32 or bfloat16 logits, shared by argmax.c and target_logprob.c:
 * the row's maximum, and whether any value is NaN (a NaN decides both answers: argmax's index,
 * log_softmax's NaN). Included under __AVX512F__. */
#ifndef BATCHGEN_ROW_MAX_H
#define BATCHGEN_ROW_MAX_H

#include <stdint.h>
#include <math.h>
#include <immintrin.h>

#include "common.h"       /* ALWAYS_INLINE */
#include "simd_load16.h"  /* tail, load16 */

/* the maximum of x[0, n) (-inf when n == 0); *any_nan set to whether a value is NaN */
ALWAYS_INLINE float row_max(const void* x, int bf16, int64_t n, int* any_nan) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i);
        const __m512 v = load16(x, bf16, i, k);
        nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        vm = _mm512_mask_max_ps(vm, k, vm, v);
    }
    *any_nan = nan != 0;
    return _mm512_reduce_max_ps(vm);
}

#endif
