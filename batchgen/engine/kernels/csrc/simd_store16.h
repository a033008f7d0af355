/* 16 lanes of f32 stored as float32 or bfloat16 (rounded as torch rounds: to nearest even, NaN
 * kept NaN), shared by pointwise.c and finish_rows.h. Included under __AVX512F__. */
#ifndef BATCHGEN_SIMD_STORE16_H
#define BATCHGEN_SIMD_STORE16_H

#include <stdint.h>
#include <immintrin.h>

#include "common.h"  /* ALWAYS_INLINE */

ALWAYS_INLINE __m256i to_bf16x16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
#endif
}

ALWAYS_INLINE __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
}

ALWAYS_INLINE void store16(void* p, int bf16, int64_t i, __mmask16 k, __m512 x) {
    if (!bf16) _mm512_mask_storeu_ps((float*)p + i, k, x);
    else _mm256_mask_storeu_epi16((uint16_t*)p + i, k, to_bf16x16(x));
}

#endif
