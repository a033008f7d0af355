/* Fused pointwise kernels for the CPU forward: RMSNorm, SiLU(gate) * up and the rotary embedding,
 * one pass each.
 *
 * Why: in eager PyTorch a Llama-style RMSNorm is eight ops (to f32, pow, mean, add, rsqrt, mul, to
 * bf16, mul) and the MLP's activation two, each a full pass over the activations plus a dispatch
 * and an OpenMP wake-up. On SmolLM2 these pointwise chains took ~26% of a bf16 prefill and ~15% of
 * a decode step. Each kernel here reads its inputs once and writes its output once, rounding
 * exactly where the eager code rounds (to bf16 after the normalization, again after the weight),
 * so results match the eager ops up to the order of the f32 sum of squares.
 *
 * Built and loaded like paged_decode.c (batchgen/engine/kernels/loader.py). dtypes: DTYPE_F32, DTYPE_BF16.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */
/* below this many elements a call runs on one thread: waking the others costs more than the work */
#define PARALLEL_MIN_ELEMS (1 << 16)

#include "bf16_convert.h"  /* bf16_to_f32, f32_to_bf16 */

ALWAYS_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_load16.h"  /* tail, load16 */

#include "simd_store16.h"  /* to_bf16x16, round_bf16x16, store16 */
#include "simd_exp.h"

#endif

/* Each row of x [rows][cols]: y = x * rsqrt(mean(x^2) + eps) in f32, rounded to x's dtype, then
 * out = weight * y rounded to the dtype: the eager Llama RMSNorm, op for op. */
ALWAYS_INLINE void rms_norm_row(const void* x, const void* w, void* out, int bf16, int64_t row, int64_t cols, float eps) {
    const int64_t base = row * cols;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 16) {
        const __m512 v = load16(x, bf16, base + j, tail(cols - j));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)cols + eps));
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 k = tail(cols - j);
        __m512 y = _mm512_mul_ps(load16(x, bf16, base + j, k), r);
        if (bf16) y = round_bf16x16(y);
        store16(out, bf16, base + j, k, _mm512_mul_ps(load16(w, bf16, j, k), y));
    }
#else
    float ss = 0.f;
    for (int64_t j = 0; j < cols; j++) {
        const float v = bf16 ? bf16_to_f32(((const uint16_t*)x)[base + j]) : ((const float*)x)[base + j];
        ss += v * v;
    }
    const float r = 1.f / sqrtf(ss / (float)cols + eps);
    for (int64_t j = 0; j < cols; j++) {
        if (bf16) {
            const float y = round_bf16(bf16_to_f32(((const uint16_t*)x)[base + j]) * r);
            ((uint16_t*)out)[base + j] = f32_to_bf16(bf16_to_f32(((const uint16_t*)w)[j]) * y);
        } else {
            ((float*)out)[base + j] = ((const float*)w)[j] * (((const float*)x)[base + j] * r);
        }
    }
#endif
}

void rms_norm(const void* x, const void* weight, void* out, int dtype, int64_t rows, int64_t cols, float eps,
              int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    #pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t row = 0; row < rows; row++) rms_norm_row(x, weight, out, bf16, row, cols, eps);
}

/* out[i] = silu(gate[i]) * up[i] for i in [0, n): silu in f32 rounded to the dtype, then the product
 * rounded to the dtype, as the eager `act_fn(gate) * up` rounds. */
ALWAYS_INLINE void silu_mul_span(const void* gate, const void* up, void* out, int bf16, int64_t n) {
#ifdef __AVX512F__
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i);
        const __m512 g = load16(gate, bf16, i, k);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        if (bf16) s = round_bf16x16(s);
        store16(out, bf16, i, k, _mm512_mul_ps(s, load16(up, bf16, i, k)));
    }
#else
    for (int64_t i = 0; i < n; i++) {
        if (bf16) {
            const float g = bf16_to_f32(((const uint16_t*)gate)[i]);
            const float s = round_bf16(g / (1.f + expf(-g)));
            ((uint16_t*)out)[i] = f32_to_bf16(s * bf16_to_f32(((const uint16_t*)up)[i]));
        } else {
            const float g = ((const float*)gate)[i];
            ((float*)out)[i] = g / (1.f + expf(-g)) * ((const float*)up)[i];
        }
    }
#endif
}

/* out = silu(gate) * up elementwise, n contiguous elements */
void silu_mul(const void* gate, const void* up, void* out, int dtype, int64_t n, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    const int64_t esize = bf16 ? 2 : 4, chunk = 4096;
    #pragma omp parallel for num_threads(num_threads) if (n >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t len = c0 + chunk < n ? chunk : n - c0;
        silu_mul_span((const char*)gate + c0 * esize, (const char*)up + c0 * esize, (char*)out + c0 * esize, bf16, len);
    }
}

/* The same over rows: gate and up [rows][cols] with row strides (in elements) gate_stride and
 * up_stride, out [rows][cols] contiguous. Why: a stacked gate/up int8 matmul
 * (engine/quant/int8_siblings.py) writes [rows][gate | up]; reading the two halves in place
 * saves copying each out first. */
void silu_mul_rows(const void* gate, const void* up, void* out, int dtype, int64_t rows, int64_t cols,
                   int64_t gate_stride, int64_t up_stride, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    const int64_t esize = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span((const char*)gate + r * gate_stride * esize, (const char*)up + r * up_stride * esize,
                      (char*)out + r * cols * esize, bf16, cols);
}

/* The rotary embedding of one head's row x [D] at one position (cos, sin [D]):
 * out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[D/2:], x[:D/2]), each product
 * and the sum rounded to the dtype, as transformers' eager apply_rotary_pos_emb rounds (negation is
 * exact and round-to-nearest-even is symmetric, so -(a * b) rounds like (-a) * b). */
ALWAYS_INLINE void rope_row(const void* x, const void* c, const void* s, void* out, int bf16, int64_t xo, int64_t co,
                            int64_t oo, int64_t half) {
#ifdef __AVX512F__
    for (int64_t j = 0; j < half; j += 16) {
        const __mmask16 k = tail(half - j);
        const __m512 x1 = load16(x, bf16, xo + j, k), x2 = load16(x, bf16, xo + half + j, k);
        __m512 a1 = _mm512_mul_ps(x1, load16(c, bf16, co + j, k)), b1 = _mm512_mul_ps(x2, load16(s, bf16, co + j, k));
        __m512 a2 = _mm512_mul_ps(x2, load16(c, bf16, co + half + j, k));
        __m512 b2 = _mm512_mul_ps(x1, load16(s, bf16, co + half + j, k));
        if (bf16) { a1 = round_bf16x16(a1); b1 = round_bf16x16(b1); a2 = round_bf16x16(a2); b2 = round_bf16x16(b2); }
        store16(out, bf16, oo + j, k, _mm512_sub_ps(a1, b1));
        store16(out, bf16, oo + half + j, k, _mm512_add_ps(a2, b2));
    }
#else
    for (int64_t j = 0; j < 2 * half; j++) {
        const int64_t r = j < half ? j + half : j - half;
        if (bf16) {
            const uint16_t* xs = (const uint16_t*)x;
            const float rot = j < half ? -bf16_to_f32(xs[xo + r]) : bf16_to_f32(xs[xo + r]);
            const float a = round_bf16(bf16_to_f32(xs[xo + j]) * bf16_to_f32(((const uint16_t*)c)[co + j]));
            const float b = round_bf16(rot * bf16_to_f32(((const uint16_t*)s)[co + j]));
            ((uint16_t*)out)[oo + j] = f32_to_bf16(a + b);
        } else {
            const float* xs = (const float*)x;
            const float rot = j < half ? -xs[xo + r] : xs[xo + r];
            ((float*)out)[oo + j] = xs[xo + j] * ((const float*)c)[co + j] + rot * ((const float*)s)[co + j];
        }
    }
#endif
}

/* q [tokens][H][D] and k [tokens][KVH][D] (the token-major memory of transformers' transposed
 * [B, heads, T, D] views), cos and sin [tokens][D]: both rotated in one pass per token. */
void rope(const void* q, const void* k, const void* cos, const void* sin, void* q_out, void* k_out, int dtype,
          int64_t tokens, int64_t H, int64_t KVH, int64_t D, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(num_threads) if (tokens * (H + KVH) * D >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < H; h++)
            rope_row(q, cos, sin, q_out, bf16, (t * H + h) * D, t * D, (t * H + h) * D, half);
        for (int64_t h = 0; h < KVH; h++)
            rope_row(k, cos, sin, k_out, bf16, (t * KVH + h) * D, t * D, (t * KVH + h) * D, half);
    }
}

/* Symmetric int8 per row, the activations of an int8 x int8 matmul (engine/quant/int8.py):
 * scales[r] = max|x[r]| / 127 and q[r][j] = round-half-even(x[r][j] * 127 / max|x[r]|), in -127..127.
 * Eagerly that is six passes (abs, amax, divide, round, clamp, cast) costing as much as the int8
 * matmul itself at SmolLM2's widths; here it is two reads of the row and one write. A zero row gets
 * scale 1 and zeros.
 * With offset 128 (quantize_rows_u8) each byte is q + 128, in 1..255: the same values as uint8 with
 * zero point 128. VNNI's vpdpbusd multiplies u8 by s8, so without AMX oneDNN's brgemm takes only
 * u8 activations (s8 ones fall to its reference kernel, far slower). */
/* x[base + j], times colscale[j] when there is one (a per-input-channel factor: 0 at a layer's
 * outlier channels, engine/quant/outliers.py, so they neither set the row's scale nor count in the
 * int8 product; 1 elsewhere): the product is taken in f32 before the row's max. */
ALWAYS_INLINE float load_scaled1(const void* x, int bf16, const float* colscale, int64_t base, int64_t j) {
    const float v = bf16 ? bf16_to_f32(((const uint16_t*)x)[base + j]) : ((const float*)x)[base + j];
    return colscale ? v * colscale[j] : v;
}

#ifdef __AVX512F__
ALWAYS_INLINE __m512 load_scaled16(const void* x, int bf16, const float* colscale, int64_t base, int64_t j,
                                   __mmask16 k) {
    const __m512 v = load16(x, bf16, base + j, k);
    return colscale ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, colscale + j)) : v;
}
#endif

ALWAYS_INLINE void quantize_row_x8(const void* x, int bf16, const float* colscale, uint8_t* q, float* scales,
                                   int64_t row, int64_t cols, int offset) {
    const int64_t base = row * cols;
#ifdef __AVX512F__
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load_scaled16(x, bf16, colscale, base, j, tail(cols - j))));
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 k = tail(cols - j);
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_scaled16(x, bf16, colscale, base, j, k), inv));  /* nearest even */
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        v = _mm512_add_epi32(v, _mm512_set1_epi32(offset));  /* -127..255: its low byte is the stored value */
        _mm_mask_storeu_epi8(q + base + j, k, _mm512_cvtepi32_epi8(v));
    }
#else
    float amax = 0.f;
    for (int64_t j = 0; j < cols; j++) {
        const float v = load_scaled1(x, bf16, colscale, base, j);
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t j = 0; j < cols; j++) {
        const float v = load_scaled1(x, bf16, colscale, base, j);
        float r = nearbyintf(v * inv);
        q[base + j] = (uint8_t)((int)(r > 127.f ? 127.f : r < -127.f ? -127.f : r) + offset);
    }
#endif
    scales[row] = amax > 0.f ? amax / 127.f : 1.f;
}

static void quantize_rows_x8(const void* x, int dtype, const float* colscale, uint8_t* q, float* scales,
                             int64_t rows, int64_t cols, int num_threads, int offset) {
    const int bf16 = dtype == DTYPE_BF16;
    #pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t row = 0; row < rows; row++) quantize_row_x8(x, bf16, colscale, q, scales, row, cols, offset);
}

void quantize_rows_s8(const void* x, int dtype, int8_t* q, float* scales, int64_t rows, int64_t cols, int num_threads) {
    quantize_rows_x8(x, dtype, NULL, (uint8_t*)q, scales, rows, cols, num_threads, 0);
}

void quantize_rows_u8(const void* x, int dtype, uint8_t* q, float* scales, int64_t rows, int64_t cols, int num_threads) {
    quantize_rows_x8(x, dtype, NULL, q, scales, rows, cols, num_threads, 128);
}

/* quantize_rows_u8 of x[r][j] * colscale[j] (colscale: cols float32 factors; engine/quant/int8.py's
 * symmetric layers with outlier channels) */
void quantize_rows_u8_scaled(const void* x, int dtype, const float* colscale, uint8_t* q, float* scales, int64_t rows,
                             int64_t cols, int num_threads) {
    quantize_rows_x8(x, dtype, colscale, q, scales, rows, cols, num_threads, 128);
}

/* Asymmetric uint8 per row, for an int8 matmul whose activations lean to one side: v = x[r][j] *
 * colscale[j] (colscale may be NULL: 1), the row's range [min(v, 0), max(v, 0)] split into 255 steps:
 * scales[r] = range / 255, zero_points[r] = round(-min / scale) and q = clamp(round(v / scale) + zp,
 * 0, 255). A row leaning to one side (SiLU(gate) * up, a norm output with one large positive
 * channel) gets up to twice the levels of the symmetric form. The zero point varies per row, so the
 * int8 matmul runs with zero point 0 and finish_asym takes zp * sum_j W[n][j] off afterwards. */
ALWAYS_INLINE void quantize_row_asym(const void* x, int bf16, const float* colscale, uint8_t* q, float* scales,
                                     float* zero_points, int64_t row, int64_t cols) {
    const int64_t base = row * cols;
    float mx = 0.f, mn = 0.f;
#ifdef __AVX512F__
    __m512 vmx = _mm512_setzero_ps(), vmn = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 k = tail(cols - j);
        const __m512 v = load_scaled16(x, bf16, colscale, base, j, k);  /* masked lanes load 0: in range */
        vmx = _mm512_max_ps(vmx, v);
        vmn = _mm512_min_ps(vmn, v);
    }
    mx = _mm512_reduce_max_ps(vmx);
    mn = _mm512_reduce_min_ps(vmn);
#else
    for (int64_t j = 0; j < cols; j++) {
        const float v = load_scaled1(x, bf16, colscale, base, j);
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
    }
#endif
    const float scale = mx > mn ? (mx - mn) / 255.f : 1.f;
    const float inv = 1.f / scale;
    float zp = nearbyintf(-mn * inv);
    zp = zp < 0.f ? 0.f : zp > 255.f ? 255.f : zp;
#ifdef __AVX512F__
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i vzp = _mm512_set1_epi32((int)zp);
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 k = tail(cols - j);
        __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_scaled16(x, bf16, colscale, base, j, k), vinv)), vzp);
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(255)), _mm512_setzero_si512());
        _mm_mask_storeu_epi8(q + base + j, k, _mm512_cvtepi32_epi8(v));
    }
#else
    for (int64_t j = 0; j < cols; j++) {
        const float r = nearbyintf(load_scaled1(x, bf16, colscale, base, j) * inv) + zp;
        q[base + j] = (uint8_t)(r > 255.f ? 255.f : r < 0.f ? 0.f : r);
    }
#endif
    scales[row] = scale;
    zero_points[row] = zp;
}

void quantize_rows_u8_asym(const void* x, int dtype, const float* colscale, uint8_t* q, float* scales,
                           float* zero_points, int64_t rows, int64_t cols, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16;
    #pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t row = 0; row < rows; row++) quantize_row_asym(x, bf16, colscale, q, scales, zero_points, row, cols);
}

#include "finish_rows.h"  /* the end of an int8 layer's call: per-token scale, zero points, outlier channels */
