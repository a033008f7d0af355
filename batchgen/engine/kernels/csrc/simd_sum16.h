/* 16 horizontal sums at once, shared by paged_decode.c's AVX-512 paths (paged_decode_bf16.h,
 * paged_decode_f32.h, paged_decode_int8.h). Included under __AVX512F__. */
#ifndef BATCHGEN_SIMD_SUM16_H
#define BATCHGEN_SIMD_SUM16_H

#include <immintrin.h>

#include "common.h"  /* ALWAYS_INLINE */

/* r[t] = the sum of a[t]'s 16 lanes, t < 16: ~3 shuffles and adds per vector, where 16
 * separate horizontal sums cost ~8 each */
ALWAYS_INLINE __m512 sum_each16(const __m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* quads 0-1: token 2i, quads 2-3: token 2i+1 */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; j++)  /* quad k: token 4j + k */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
    for (int m = 0; m < 2; m++)  /* quad k: tokens 8m + k and 8m + 4 + k, two lanes each */
        d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* lane 4k + j of e holds token 4j + k */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

#endif
