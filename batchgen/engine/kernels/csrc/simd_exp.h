/* exp on 16 AVX-512 lanes, shared by the softmaxes (paged_decode_common.h, prefill_attention.c,
 * sample_rows.h, target_logprob.c) and pointwise.c (SiLU). Included under __AVX512F__. */
#ifndef BATCHGEN_SIMD_EXP_H
#define BATCHGEN_SIMD_EXP_H

#include <math.h>
#include <immintrin.h>

#include "common.h"  /* ALWAYS_INLINE */

/* exp(x) on 16 lanes: Cody-Waite reduction and Cephes' degree-5 polynomial; +inf past f32's range
 * (as expf), so silu of a very negative gate is -0 as in torch, below -87 a denormal-free tiny value */
ALWAYS_INLINE __m512 exp16(__m512 x_in) {
    const __mmask16 overflow = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(88.7228394f), _CMP_GT_OQ);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(x_in, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                          _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    /* y * 2^n in one instruction (vscalefps), rounded once where it is denormal; n stays in
     * [-126, 127] by the clamp. The same bits as building 2^n in the exponent field as two factors
     * (checked over all 2^32 inputs when this replaced that), in fewer instructions. */
    return _mm512_mask_blend_ps(overflow, _mm512_scalef_ps(y, n), _mm512_set1_ps(INFINITY));
}

#endif
