/* What paged_decode.c's generic loops and its AVX-512 paths (paged_decode_bf16.h, paged_decode_f32.h,
 * paged_decode_int8.h) share: a layer's score rules, the softmax under them, and an output row
 * stored in the query's dtype. */
#ifndef BATCHGEN_PAGED_DECODE_COMMON_H
#define BATCHGEN_PAGED_DECODE_COMMON_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"        /* ALWAYS_INLINE, DTYPE_BF16 */
#include "bf16_convert.h"  /* f32_to_bf16 */

#ifdef __AVX512F__
#include <immintrin.h>
/* The softmax's exp on 16 lanes (simd_exp.h). GCC leaves the scalar exp_nonpositive below
 * unvectorized (its 2^n bit cast goes through memory), which made the softmax as costly as the K
 * and V passes together. */
#include "simd_exp.h"
#endif

ALWAYS_INLINE void store_row(void* base, int is_bf16, int64_t offset, int n, const float* restrict src, float mul) {
    if (!is_bf16) {
        float* dst = (float*)base + offset;
        for (int i = 0; i < n; i++) dst[i] = src[i] * mul;
    } else {
        uint16_t* dst = (uint16_t*)base + offset;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * mul);
    }
}

/* exp(x) for x <= 0 (scores minus their max), vectorisable: Cody-Waite range reduction and Cephes'
 * degree-5 polynomial, about 1 ulp; glibc's expf would be a scalar call per score. */
ALWAYS_INLINE float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

/* A layer's score rules for one sequence (batchgen/engine/score_rules.py, ScoreRules). */
typedef struct {
    int lead;            /* scores [0, lead) fall before the sliding window: probability 0 */
    float softcap;       /* > 0: scores -> tanh(scores / softcap) * softcap (Gemma 2) */
    const float* sinks;  /* [H] or NULL: one logit per head in its softmax denominator (gpt-oss) */
} Rules;

/* One row of n scores in, probabilities out; a sink logit (has_sink) joins the max and the sum only. */
ALWAYS_INLINE void softmax_row(float* sh, int n, int has_sink, float sink) {
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        vm = _mm512_mask_max_ps(vm, k, vm, _mm512_maskz_loadu_ps(k, sh + t));
    }
    float mx = _mm512_reduce_max_ps(vm);
    if (has_sink && sink > mx) mx = sink;
    const __m512 m = _mm512_set1_ps(mx);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), m));
        _mm512_mask_storeu_ps(sh + t, k, e);
        vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
    }
    const float sum = _mm512_reduce_add_ps(vsum) + (has_sink ? expf(sink - mx) : 0.f);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        _mm512_mask_storeu_ps(sh + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sh + t), inv));
    }
#else
    float m = sh[0], sum = 0.f;
    #pragma omp simd reduction(max:m)
    for (int t = 1; t < n; t++) m = sh[t] > m ? sh[t] : m;
    if (has_sink && sink > m) m = sink;
    #pragma omp simd reduction(+:sum)
    for (int t = 0; t < n; t++) { sh[t] = exp_nonpositive(sh[t] - m); sum += sh[t]; }
    if (has_sink) sum += expf(sink - m);
    const float inv = 1.f / sum;
    #pragma omp simd
    for (int t = 0; t < n; t++) sh[t] *= inv;
#endif
}

/* Each of the H rows of s [H][ctx], scores in, probabilities out, under the layer's rules: keys
 * before the window get 0, softcapping squashes the scores first, a sink joins the denominator. */
ALWAYS_INLINE void softmax_rows(float* s, int H, int ctx, const Rules* r) {
    for (int hq = 0; hq < H; hq++) {
        float* sh = s + (int64_t)hq * ctx;
        if (r->softcap > 0.f) {
            const float cap = r->softcap, inv_cap = 1.f / r->softcap;
            for (int t = r->lead; t < ctx; t++) sh[t] = tanhf(sh[t] * inv_cap) * cap;
        }
        softmax_row(sh + r->lead, ctx - r->lead, r->sinks != NULL, r->sinks ? r->sinks[hq] : 0.f);
        memset(sh, 0, sizeof(float) * r->lead);
    }
}

#endif
