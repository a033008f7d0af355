/* The int8 KV cache's write (engine/kv/quant.py): one step's new K and V quantized per token and
 * KV head and scattered into the pages at slot_mapping, in one call per layer.
 *
 * Why: the torch write is ~25 small ops per layer (float, abs, amax, div, clamp, to bf16, round,
 * clamp, to int8 for K and V, then four index_copy_) for a few KB of data; at a decode step every
 * one is a dispatch costing more than its arithmetic, times every layer.
 *
 * Bit for bit what kv_quant.quantize computes, so a model's int8 cache holds the same bytes with
 * or without this library: scale = max|x| / 127 over head_dim in float32 (a true division), at
 * least MIN_SCALE, rounded to bf16 (nearest even); q = round-half-even(x / scale_bf16) (again a
 * true division, not a multiply by the reciprocal, whose rounding differs), clamped to +-127.
 * NaN inputs are not reproduced (torch's NaN -> int8 cast is undefined behaviour anyway).
 *
 * Built and loaded like pointwise.c (batchgen/engine/kernels/loader.py). dtypes: DTYPE_F32, DTYPE_BF16.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */
#define QMAX 127.f
#define MIN_SCALE 1e-12f  /* kv_quant.MIN_SCALE as torch's clamp_min sees it: rounded to float32 */
/* below this many elements a call runs on one thread: a decode step's K/V are a few KB */
#define PARALLEL_MIN_ELEMS (1 << 16)

#include "bf16_convert.h"  /* bf16_to_f32, f32_to_bf16 */

/* the bf16 scale (as stored) of one head's max |x| */
ALWAYS_INLINE uint16_t scale_bits(float amax) {
    const float s = amax / QMAX;
    return f32_to_bf16(s < MIN_SCALE ? MIN_SCALE : s);
}

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_load16.h"  /* tail, load16 */

/* one head's head_dim values at x[off...] -> q[0..D) and its scale's bf16 bits */
ALWAYS_INLINE uint16_t quantize_head(const void* x, int bf16, int64_t off, int64_t D, int8_t* q) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, bf16, off + j, tail(D - j))));
    const uint16_t sb = scale_bits(_mm512_reduce_max_ps(mx));
    const __m512 s = _mm512_set1_ps(bf16_to_f32(sb));
    const __m512 lo = _mm512_set1_ps(-QMAX), hi = _mm512_set1_ps(QMAX);
    for (int64_t j = 0; j < D; j += 16) {
        const __mmask16 k = tail(D - j);
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, off + j, k), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        _mm_mask_storeu_epi8(q + j, k, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
    }
    return sb;
}
#else
ALWAYS_INLINE float load1(const void* x, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

ALWAYS_INLINE uint16_t quantize_head(const void* x, int bf16, int64_t off, int64_t D, int8_t* q) {
    float amax = 0.f;
    for (int64_t j = 0; j < D; j++) {
        const float a = fabsf(load1(x, bf16, off + j));
        amax = a > amax ? a : amax;
    }
    const uint16_t sb = scale_bits(amax);
    const float s = bf16_to_f32(sb);
    for (int64_t j = 0; j < D; j++) {
        const float r = nearbyintf(load1(x, bf16, off + j) / s);  /* the default mode: half to even */
        q[j] = (int8_t)(r > QMAX ? QMAX : r < -QMAX ? -QMAX : r);
    }
    return sb;
}
#endif

/* k and v: [tokens][heads][head_dim] with token and head strides in elements (head_dim contiguous:
 * q/k/v reach the attention op as transposed views); slots[t]: token t's cache slot. The caches
 * are [num_slots][heads][head_dim] int8 and the scales [num_slots][heads] bf16, all contiguous.
 * Returns the number of slots outside [0, num_slots); nothing is written unless it is 0. */
int64_t kv_quant_write(const void* k, const void* v, int dtype, int64_t k_tok_stride, int64_t k_head_stride,
                       int64_t v_tok_stride, int64_t v_head_stride, const int64_t* slots, int64_t tokens,
                       int64_t heads, int64_t head_dim, int64_t num_slots, int8_t* k_cache, int8_t* v_cache,
                       uint16_t* k_scale, uint16_t* v_scale, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    int64_t bad = 0;
    for (int64_t t = 0; t < tokens; t++) bad += slots[t] < 0 || slots[t] >= num_slots;
    if (bad) return bad;
    #pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS) \
        schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < heads; h++) {
            const int64_t dst = slot * heads + h;
            k_scale[dst] = quantize_head(k, bf16, t * k_tok_stride + h * k_head_stride, head_dim, k_cache + dst * head_dim);
            v_scale[dst] = quantize_head(v, bf16, t * v_tok_stride + h * v_head_stride, head_dim, v_cache + dst * head_dim);
        }
    }
    return 0;
}
