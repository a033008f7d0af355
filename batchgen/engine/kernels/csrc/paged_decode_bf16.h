/* paged_decode.c's path for bf16 queries over bf16 pages on AVX512-BF16 CPUs; included by it and
 * compiled in the same unit. */
#ifndef BATCHGEN_PAGED_DECODE_BF16_H
#define BATCHGEN_PAGED_DECODE_BF16_H

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <stdint.h>
#include <immintrin.h>

#include "common.h"               /* ALWAYS_INLINE, DTYPE_BF16 */
#include "paged_decode_common.h"  /* Rules, softmax_rows, store_row */
#include "paged_rows.h"           /* group_rows, next_group, unpair_dims, GV_MAX */
#include "simd_sum16.h"           /* sum_each16 */

/* bf16 queries over bf16 pages on CPUs with AVX512-BF16 (vdpbf16ps): the common case, and the
 * one the generic loops above serve worst. They are compute-bound, not memory-bound (3-4 GB/s a
 * core from cache or DRAM alike, against 13 GB/s a core of copy bandwidth): each token pays a
 * bf16 -> f32 pass over its row and one horizontal sum per query head. Here K is dotted in bf16
 * pairs with f32 accumulation (the products are exact in f32), 16 tokens' sums are reduced
 * together by one shuffle tree, and V accumulates in registers, one KV head at a time, two tokens
 * per vdpbf16ps: their rows interleaved into (v_t[d], v_t+1[d]) pairs against the pair of their
 * probabilities rounded to bf16 (the relative error of a bf16 output, and half the instructions
 * of widening each row to f32 for FMAs). */
#define HAVE_BF16_PATH 1

/* One sequence, 16 tokens at a time, each group's rows read whole (all KV heads) once per pass;
 * D % 32 == 0 and D <= 256. q, out: bf16 [H][D]. */
ALWAYS_INLINE void attend_bf16(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                               const int32_t* table, int ctx, int H, int KVH, const int D, int block_size,
                               float scale, const Rules* rules, float* restrict buf) {
    const int G = H / KVH, row_bytes = KVH * D * 2, NC = D / 16, GV = 256 / D;  /* GV heads x NC chunks: 16 registers */
    float* acc = buf;        /* [H][D] */
    float* s = acc + H * D;  /* [H][ctx] */
    const char *rows[16], *next[16];
    int blk = 0, i = 0, nblk = 0, ni = 0;
    int n = ctx < 16 ? ctx : 16;
    group_rows((const char*)k_cache, table, block_size, row_bytes, n, &blk, &i, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group((const char*)k_cache, table, block_size, row_bytes, ctx, t0, &blk, &i, next);
        for (int h = 0; h < KVH; h++) {
            for (int g = 0; g < G; g++) {
                const uint16_t* qh = q + (int64_t)(h * G + g) * D;
                __m512 a[16];
                for (int tt = 0; tt < 16; tt++) {
                    __m512 dot = _mm512_setzero_ps();
                    if (tt < n)
                        for (int c = 0; c < D / 32; c++)
                            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * c),
                                                   (__m512bh)_mm512_loadu_si512((const uint16_t*)rows[tt] + h * D + 32 * c));
                    a[tt] = dot;
                }
                _mm512_mask_storeu_ps(s + (int64_t)(h * G + g) * ctx + t0, (__mmask16)((1u << n) - 1),
                                      _mm512_mul_ps(sum_each16(a), _mm512_set1_ps(scale)));
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    softmax_rows(s, H, ctx, rules);
    memset(acc, 0, sizeof(float) * H * D);
    n = ctx < 16 ? ctx : 16;
    group_rows((const char*)v_cache, table, block_size, row_bytes, n, &nblk, &ni, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group((const char*)v_cache, table, block_size, row_bytes, ctx, t0, &nblk, &ni, next);
        for (int h = 0; h < KVH; h++) {
            for (int g0 = 0; g0 < G; g0 += GV) {
                const int ng = G - g0 < GV ? G - g0 : GV;
                const float* p = s + (int64_t)(h * G + g0) * ctx + t0;
                float* ah = acc + (h * G + g0) * D;
                __m512 va[16];
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) va[gi * NC + c] = _mm512_loadu_ps(ah + gi * D + 16 * c);
                /* the group's probabilities as bf16, zero past n: each pair (tt, tt + 1) is one
                 * 32-bit broadcast operand of vdpbf16ps */
                uint16_t pb[GV_MAX][16];
                const __mmask16 live = (__mmask16)((1u << n) - 1);
                for (int gi = 0; gi < ng; gi++)
                    _mm256_storeu_si256((__m256i*)pb[gi], (__m256i)_mm512_cvtneps_pbh(
                        _mm512_maskz_loadu_ps(live, p + gi * ctx)));
                for (int tt = 0; tt < n; tt += 2) {
                    const uint16_t* ra = (const uint16_t*)rows[tt] + h * D;
                    const uint16_t* rb = tt + 1 < n ? (const uint16_t*)rows[tt + 1] + h * D : ra;  /* its probability is 0 */
                    for (int c2 = 0; c2 < D / 32; c2++) {
                        const __m512i a = _mm512_loadu_si512(ra + 32 * c2), b = _mm512_loadu_si512(rb + 32 * c2);
                        /* (v_tt[d], v_tt+1[d]) pairs; lo holds dims 8L + 0..3 of each 128-bit lane L,
                         * hi dims 8L + 4..7: the accumulators keep that order until unpair_dims */
                        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
                        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                        for (int gi = 0; gi < GV; gi++)
                            if (gi < ng) {
                                int32_t pair;
                                memcpy(&pair, pb[gi] + tt, 4);
                                const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
                                va[gi * NC + 2 * c2] = _mm512_dpbf16_ps(va[gi * NC + 2 * c2], pp, lo);
                                va[gi * NC + 2 * c2 + 1] = _mm512_dpbf16_ps(va[gi * NC + 2 * c2 + 1], pp, hi);
                            }
                    }
                }
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) _mm512_storeu_ps(ah + gi * D + 16 * c, va[gi * NC + c]);
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    unpair_dims(acc, H * D);
    store_row(out, DTYPE_BF16, 0, H * D, acc, 1.f);
}

#define SPECIALISE_BF16(DIM) \
    static void attend_bf16_d##DIM(const uint16_t* q, uint16_t* out, const uint16_t* k, const uint16_t* v, \
                                   const int32_t* table, int ctx, int H, int KVH, int bs, float scale, const Rules* rules, float* buf) { \
        attend_bf16(q, out, k, v, table, ctx, H, KVH, DIM, bs, scale, rules, buf); \
    }
SPECIALISE_BF16(64)
SPECIALISE_BF16(128)
#endif

#endif
