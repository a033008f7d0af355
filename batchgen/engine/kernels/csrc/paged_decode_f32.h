/* paged_decode.c's path for float32 queries over float32 pages on AVX-512 CPUs; included by it and
 * compiled in the same unit.
 *
 * The generic loops (attend_one) copy each token's row into a buffer, reduce every q . k dot
 * product horizontally on its own and keep V's accumulators in memory: once float32 linear layers
 * ran on oneDNN, decode attention became a third of a float32 step. Here, as in the bf16 path,
 * 16 tokens' dot products are reduced together by one shuffle tree and V accumulates in
 * registers, reading the pages in place. */
#ifndef BATCHGEN_PAGED_DECODE_F32_H
#define BATCHGEN_PAGED_DECODE_F32_H

/* on the CPUs of the bf16 path (AVX512-BF16) only: elsewhere float32 decode keeps the generic loops */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_F32_PATH 1
#include <stdint.h>
#include <immintrin.h>

#include "common.h"               /* ALWAYS_INLINE */
#include "paged_decode_common.h"  /* Rules, softmax_rows */
#include "simd_sum16.h"           /* sum_each16 */

/* The rows of tokens [t0, t0 + n) of one sequence (all KV heads), n <= 16, prefetched. */
ALWAYS_INLINE void f32_group(const float* cache, const int32_t* table, int block_size, int row_len, int t0, int n,
                             const float** rows) {
    for (int tt = 0; tt < n; tt++) {
        const int t = t0 + tt;
        rows[tt] = cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_len;
    }
}

ALWAYS_INLINE void f32_prefetch(const float* const* rows, int n, int row_len) {
    for (int tt = 0; tt < n; tt++)
        for (int off = 0; off < row_len * 4; off += 64) __builtin_prefetch((const char*)rows[tt] + off, 0, 3);
}

/* One sequence; D % 16 == 0 and D <= 256. q, out: float32 [H][D]. */
ALWAYS_INLINE void attend_f32(const float* q, float* out, const float* k_cache, const float* v_cache,
                              const int32_t* table, int ctx, int H, int KVH, const int D, int block_size,
                              float scale, const Rules* rules, float* restrict buf) {
    const int G = H / KVH, row_len = KVH * D, NC = D / 16, GV = 256 / D;  /* GV heads x NC chunks: 16 registers */
    float* acc = buf;        /* [H][D] */
    float* s = acc + H * D;  /* [H][ctx] */
    const float *rows[16], *next[16];
    int n = ctx < 16 ? ctx : 16;
    f32_group(k_cache, table, block_size, row_len, 0, n, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = ctx - t0 - 16 < 16 ? (ctx - t0 - 16 > 0 ? ctx - t0 - 16 : 0) : 16;
        if (nn) { f32_group(k_cache, table, block_size, row_len, t0 + 16, nn, next); f32_prefetch(next, nn, row_len); }
        for (int hq = 0; hq < H; hq++) {
            const float* qh = q + (int64_t)hq * D;
            const int h = hq / G;
            __m512 a[16];
            for (int tt = 0; tt < 16; tt++) {
                __m512 dot = _mm512_setzero_ps();
                if (tt < n)
                    for (int c = 0; c < NC; c++)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_loadu_ps(rows[tt] + h * D + 16 * c), dot);
                a[tt] = dot;
            }
            _mm512_mask_storeu_ps(s + (int64_t)hq * ctx + t0, (__mmask16)((1u << n) - 1),
                                  _mm512_mul_ps(sum_each16(a), _mm512_set1_ps(scale)));
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    softmax_rows(s, H, ctx, rules);
    memset(acc, 0, sizeof(float) * H * D);
    n = ctx < 16 ? ctx : 16;
    f32_group(v_cache, table, block_size, row_len, 0, n, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = ctx - t0 - 16 < 16 ? (ctx - t0 - 16 > 0 ? ctx - t0 - 16 : 0) : 16;
        if (nn) { f32_group(v_cache, table, block_size, row_len, t0 + 16, nn, next); f32_prefetch(next, nn, row_len); }
        for (int h = 0; h < KVH; h++) {
            for (int g0 = 0; g0 < G; g0 += GV) {
                const int ng = G - g0 < GV ? G - g0 : GV;
                const float* p = s + (int64_t)(h * G + g0) * ctx + t0;
                float* ah = acc + (h * G + g0) * D;
                __m512 va[16];
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) va[gi * NC + c] = _mm512_loadu_ps(ah + gi * D + 16 * c);
                for (int tt = 0; tt < n; tt++)
                    for (int c = 0; c < NC; c++) {
                        const __m512 x = _mm512_loadu_ps(rows[tt] + h * D + 16 * c);
                        for (int gi = 0; gi < GV; gi++)
                            if (gi < ng)
                                va[gi * NC + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[gi * ctx + tt]), x, va[gi * NC + c]);
                    }
                for (int gi = 0; gi < GV; gi++)
                    for (int c = 0; c < NC; c++)
                        if (gi < ng) _mm512_storeu_ps(ah + gi * D + 16 * c, va[gi * NC + c]);
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    memcpy(out, acc, sizeof(float) * H * D);
}

#define SPECIALISE_F32(DIM) \
    static void attend_f32_d##DIM(const float* q, float* out, const float* k, const float* v, \
                                  const int32_t* table, int ctx, int H, int KVH, int bs, float scale, const Rules* rules, float* buf) { \
        attend_f32(q, out, k, v, table, ctx, H, KVH, DIM, bs, scale, rules, buf); \
    }
SPECIALISE_F32(64)
SPECIALISE_F32(128)
#endif

#endif
