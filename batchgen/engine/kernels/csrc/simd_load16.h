/* 16 lanes of float32 or bfloat16 rows as f32, shared by the csrc/ files that read such rows.
 * Included under __AVX512F__. */
#ifndef BATCHGEN_SIMD_LOAD16_H
#define BATCHGEN_SIMD_LOAD16_H

#include <stdint.h>
#include <immintrin.h>

#include "common.h"  /* ALWAYS_INLINE */

/* the lanes of the last 16 of `left` elements (all 16 when 16 or more are left) */
ALWAYS_INLINE __mmask16 tail(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* elements [i, i + 16) of p (float32, or bf16 when bf16), lanes outside k read as 0 */
ALWAYS_INLINE __m512 load16(const void* p, int bf16, int64_t i, __mmask16 k) {
    if (!bf16) return _mm512_maskz_loadu_ps(k, (const float*)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t*)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#endif
