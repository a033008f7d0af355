/* paged_decode.c's path for bf16 queries over int8 pages (--kv-cache-dtype int8) on CPUs with
 * AVX512-VNNI; included by it and compiled in the same unit.
 *
 * Why: the generic loops widen every int8 value to f32 and multiply one lane at a time, which made
 * int8 pages slower to read than bf16 ones although they are half the bytes. Here both passes
 * multiply 16-bit integers pairwise into int32 lanes (vpdpwssd), the same shape as the bf16 path's
 * vdpbf16ps:
 *   K: the query is quantized per head to int16 (scale max|q| / 32767: a relative error ~100x
 *      below the query's own bf16 rounding), each K row widened int8 -> int16 by one vpmovsxbw,
 *      and the sums turned to scores by q's scale, the token's K scale and the softmax scale,
 *      outside the inner loops.
 *   V: each probability times its token's V scale, quantized to int16 against the largest of its
 *      256-token chunk (256 x 32767 x 127 < 2^31: a chunk's int32 sums cannot overflow), two tokens'
 *      rows interleaved into pairs as in the bf16 path, and each chunk's int32 sums added to the f32
 *      output with the chunk's scale. Where the bf16 path rounds probabilities to bf16 (2^-9
 *      relative), this keeps 1/65534 of the chunk's largest.
 * The values read are exactly the cache's, so the result is the dequantized cache's attention up to
 * those roundings. */
#ifndef BATCHGEN_PAGED_DECODE_INT8_H
#define BATCHGEN_PAGED_DECODE_INT8_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_INT8_PATH 1
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#include "common.h"               /* ALWAYS_INLINE, DTYPE_BF16 */
#include "bf16_convert.h"         /* bf16_to_f32 */
#include "paged_decode_common.h"  /* Rules, softmax_rows, store_row */
#include "paged_rows.h"           /* group_rows, next_group, bf16x16_to_f32 */
#include "simd_sum16.h"           /* sum_each16 */
#define V_CHUNK 256  /* tokens per int32 accumulation of the V pass */

/* Scratch floats attend_int8 needs for one sequence of ctx tokens (ints count as floats). */
static size_t int8_scratch_floats(int H, int D, int ctx) {
    const size_t ctx16 = (size_t)(ctx + 15) / 16 * 16;  /* the layout is attend_int8's; KVH <= H */
    return 2 * (size_t)H * D + (size_t)H * ctx16 + (size_t)H * ctx16 / 2 + (size_t)H * D / 2 + H
           + (size_t)H * ctx16 + (size_t)H * (ctx16 / V_CHUNK + 1) + 64;
}

/* q16[h] = round(q[h] / qs[h]) with qs[h] = max|q[h]| / 32767 (1 for an all-zero head). */
ALWAYS_INLINE void quantize_query16(const uint16_t* q, int H, const int D, int16_t* q16, float* qs) {
    for (int hq = 0; hq < H; hq++) {
        __m512 vmax = _mm512_setzero_ps();
        for (int c = 0; c < D / 16; c++) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(bf16x16_to_f32(q + hq * D + 16 * c)));
        const float m = _mm512_reduce_max_ps(vmax);
        const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
        qs[hq] = m > 0.f ? m / 32767.f : 1.f;
        for (int c = 0; c < D / 16; c++)  /* saturating narrow: x * inv may round to 32767.0001 */
            _mm256_storeu_si256((__m256i*)(q16 + hq * D + 16 * c), _mm512_cvtsepi32_epi16(
                _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(q + hq * D + 16 * c), inv))));
    }
}

/* The probabilities of H rows of s [H][ctx] times each token's V scale (vsc [KVH][ctx], head h
 * serving query heads [h * G, h * G + G)), as int16 p16 [H][ctx16] (zero past ctx) against the
 * largest of each V_CHUNK tokens, whose value / 32767 goes to cs [H][chunks]. */
ALWAYS_INLINE void quantize_probs16(const float* s, const float* vsc, int H, int G, int ctx, int ctx16,
                                    int16_t* p16, float* cs) {
    const int chunks = (ctx16 + V_CHUNK - 1) / V_CHUNK;
    for (int hq = 0; hq < H; hq++) {
        const float* sh = s + (int64_t)hq * ctx;
        const float* vh = vsc + (int64_t)(hq / G) * ctx16;
        for (int ch = 0; ch < chunks; ch++) {
            const int t_end = (ch + 1) * V_CHUNK < ctx16 ? (ch + 1) * V_CHUNK : ctx16;
            __m512 vmax = _mm512_setzero_ps();
            for (int t = ch * V_CHUNK; t < t_end; t += 16) {
                const __mmask16 k = t >= ctx ? 0 : ctx - t >= 16 ? 0xFFFF : (__mmask16)((1u << (ctx - t)) - 1);
                vmax = _mm512_max_ps(vmax, _mm512_maskz_mul_ps(k, _mm512_maskz_loadu_ps(k, sh + t),
                                                               _mm512_loadu_ps(vh + t)));
            }
            const float m = _mm512_reduce_max_ps(vmax);
            const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
            cs[hq * chunks + ch] = m / 32767.f;
            for (int t = ch * V_CHUNK; t < t_end; t += 16) {
                const __mmask16 k = t >= ctx ? 0 : ctx - t >= 16 ? 0xFFFF : (__mmask16)((1u << (ctx - t)) - 1);
                const __m512 p = _mm512_maskz_mul_ps(k, _mm512_maskz_loadu_ps(k, sh + t), _mm512_loadu_ps(vh + t));
                _mm256_storeu_si256((__m256i*)(p16 + (int64_t)hq * ctx16 + t),
                                    _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p, inv))));
            }
        }
    }
}

/* One sequence, 16 tokens at a time, like attend_bf16; D % 32 == 0 and D <= 256 (GV heads x NC
 * chunks of V accumulators: at most 16 registers). q, out: bf16
 * [H][D]; caches int8 [num_slots][KVH][D] with bf16 scales [num_slots][KVH]. */
ALWAYS_INLINE void attend_int8(const uint16_t* q, uint16_t* out, const int8_t* k_cache, const int8_t* v_cache,
                               const uint16_t* k_scales, const uint16_t* v_scales, const int32_t* table, int ctx,
                               int H, int KVH, const int D, int block_size, float scale, const Rules* rules,
                               float* restrict buf) {
    const int G = H / KVH, row_bytes = KVH * D, NC = D / 16, GV = 256 / D;
    const int ctx16 = (ctx + 15) / 16 * 16, chunks = (ctx16 + V_CHUNK - 1) / V_CHUNK;
    float* acc = buf;                                    /* [H][D] f32 output */
    int32_t* acc32 = (int32_t*)(acc + H * D);            /* [H][D] one chunk's int32 sums */
    float* s = (float*)(acc32 + H * D);                  /* [H][ctx] scores, then probabilities */
    int16_t* p16 = (int16_t*)(s + (int64_t)H * ctx16);   /* [H][ctx16] */
    int16_t* q16 = p16 + (int64_t)H * ctx16;             /* [H][D] */
    float* qs = (float*)(q16 + H * D);                   /* [H] */
    float* vsc = qs + H;                                 /* [KVH][ctx16] V scales, then chunk scales */
    float* cs = vsc + (int64_t)KVH * ctx16;              /* [H][chunks] */
    quantize_query16(q, H, D, q16, qs);
    const char *rows[16], *next[16];
    int blk = 0, i = 0, nblk = 0, ni = 0;
    int n = ctx < 16 ? ctx : 16;
    group_rows((const char*)k_cache, table, block_size, row_bytes, n, &blk, &i, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group((const char*)k_cache, table, block_size, row_bytes, ctx, t0, &blk, &i, next);
        int64_t slot[16];
        for (int tt = 0; tt < n; tt++) slot[tt] = (rows[tt] - (const char*)k_cache) / row_bytes;
        for (int h = 0; h < KVH; h++) {
            float ks[16] = {0}, vs_h[16] = {0};
            for (int tt = 0; tt < n; tt++) {
                ks[tt] = bf16_to_f32(k_scales[slot[tt] * KVH + h]);
                vs_h[tt] = bf16_to_f32(v_scales[slot[tt] * KVH + h]);
            }
            _mm512_storeu_ps(vsc + (int64_t)h * ctx16 + t0, _mm512_loadu_ps(vs_h));
            const __m512 ksv = _mm512_mul_ps(_mm512_loadu_ps(ks), _mm512_set1_ps(scale));
            for (int g = 0; g < G; g++) {
                const int16_t* qh = q16 + (h * G + g) * D;
                __m512 a[16];
                for (int tt = 0; tt < 16; tt++) {
                    __m512i dot = _mm512_setzero_si512();
                    if (tt < n)
                        for (int c = 0; c < D / 32; c++)
                            dot = _mm512_dpwssd_epi32(dot, _mm512_loadu_si512(qh + 32 * c), _mm512_cvtepi8_epi16(
                                _mm256_loadu_si256((const __m256i*)(rows[tt] + h * D + 32 * c))));
                    a[tt] = _mm512_cvtepi32_ps(dot);
                }
                _mm512_mask_storeu_ps(s + (int64_t)(h * G + g) * ctx + t0, (__mmask16)((1u << n) - 1),
                                      _mm512_mul_ps(_mm512_mul_ps(sum_each16(a), ksv), _mm512_set1_ps(qs[h * G + g])));
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    softmax_rows(s, H, ctx, rules);
    quantize_probs16(s, vsc, H, G, ctx, ctx16, p16, cs);
    memset(acc, 0, sizeof(float) * H * D);
    memset(acc32, 0, sizeof(int32_t) * H * D);
    n = ctx < 16 ? ctx : 16;
    group_rows((const char*)v_cache, table, block_size, row_bytes, n, &nblk, &ni, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group((const char*)v_cache, table, block_size, row_bytes, ctx, t0, &nblk, &ni, next);
        for (int h = 0; h < KVH; h++) {
            for (int g0 = 0; g0 < G; g0 += GV) {
                const int ng = G - g0 < GV ? G - g0 : GV;
                const int16_t* p = p16 + (int64_t)(h * G + g0) * ctx16 + t0;
                int32_t* ah = acc32 + (h * G + g0) * D;
                __m512i va[16];
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) va[gi * NC + c] = _mm512_loadu_si512(ah + gi * D + 16 * c);
                for (int tt = 0; tt < n; tt += 2) {
                    const int8_t* ra = (const int8_t*)rows[tt] + h * D;
                    const int8_t* rb = tt + 1 < n ? (const int8_t*)rows[tt + 1] + h * D : ra;  /* its p16 is 0 */
                    for (int c2 = 0; c2 < D / 32; c2++) {
                        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(ra + 32 * c2)));
                        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(rb + 32 * c2)));
                        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                        for (int gi = 0; gi < GV; gi++)
                            if (gi < ng) {
                                int32_t pair;
                                memcpy(&pair, p + (int64_t)gi * ctx16 + tt, 4);
                                const __m512i pp = _mm512_set1_epi32(pair);
                                va[gi * NC + 2 * c2] = _mm512_dpwssd_epi32(va[gi * NC + 2 * c2], pp, lo);
                                va[gi * NC + 2 * c2 + 1] = _mm512_dpwssd_epi32(va[gi * NC + 2 * c2 + 1], pp, hi);
                            }
                    }
                }
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) _mm512_storeu_si512(ah + gi * D + 16 * c, va[gi * NC + c]);
            }
        }
        if ((t0 + 16) % V_CHUNK == 0 || t0 + 16 >= ctx) {  /* the chunk's sums into the f32 output */
            const int ch = t0 / V_CHUNK;
            for (int hq = 0; hq < H; hq++) {
                const __m512 csv = _mm512_set1_ps(cs[hq * chunks + ch]);
                for (int c = 0; c < NC; c++) {
                    float* o = acc + hq * D + 16 * c;
                    int32_t* a32 = acc32 + hq * D + 16 * c;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a32)), csv,
                                                        _mm512_loadu_ps(o)));
                    _mm512_storeu_si512(a32, _mm512_setzero_si512());
                }
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    unpair_dims(acc, H * D);
    store_row(out, DTYPE_BF16, 0, H * D, acc, 1.f);
}

#define SPECIALISE_INT8(DIM) \
    static void attend_int8_d##DIM(const uint16_t* q, uint16_t* out, const int8_t* k, const int8_t* v, \
                                   const uint16_t* ks, const uint16_t* vs, const int32_t* table, int ctx, int H, \
                                   int KVH, int bs, float scale, const Rules* rules, float* buf) { \
        attend_int8(q, out, k, v, ks, vs, table, ctx, H, KVH, DIM, bs, scale, rules, buf); \
    }
SPECIALISE_INT8(32)
SPECIALISE_INT8(64)
SPECIALISE_INT8(96)
SPECIALISE_INT8(128)
SPECIALISE_INT8(256)

/* 1 when attend_int8 has a specialisation for head size D */
static int int8_path_supports(int D) { return D == 32 || D == 64 || D == 96 || D == 128 || D == 256; }
#endif

#endif
