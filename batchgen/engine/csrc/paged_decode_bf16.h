/* paged_decode.c's path for bf16 queries over bf16 pages on AVX512-BF16 CPUs; included by it
 * (it needs its ALWAYS_INLINE, store_row and softmax_rows) and compiled in the same unit. */
#ifndef BATCHGEN_PAGED_DECODE_BF16_H
#define BATCHGEN_PAGED_DECODE_BF16_H

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 queries over bf16 pages on CPUs with AVX512-BF16 (vdpbf16ps): the common case, and the
 * one the generic loops above serve worst. They are compute-bound, not memory-bound (3-4 GB/s a
 * core from cache or DRAM alike, against 13 GB/s a core of copy bandwidth): each token pays a
 * bf16 -> f32 pass over its row and one horizontal sum per query head. Here K is dotted in bf16
 * pairs with f32 accumulation (the products are exact in f32), 16 tokens' sums are reduced
 * together by one shuffle tree, and V accumulates in registers, one KV head at a time, two tokens
 * per vdpbf16ps: their rows interleaved into (v_t[d], v_t+1[d]) pairs against the pair of their
 * probabilities rounded to bf16 (the relative error of a bf16 output, and half the instructions
 * of widening each row to f32 for FMAs: 1.3-1.7x the whole kernel at 128 sequences of 400 tokens). */
#define HAVE_BF16_PATH 1

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

ALWAYS_INLINE __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* The cache rows of tokens [t0, t0 + n) of one sequence, n <= 16; *blk and *i walk its block table. */
ALWAYS_INLINE void group_rows(const uint16_t* cache, const int32_t* table, int block_size, int row_len, int n,
                              int* blk, int* i, const uint16_t** rows) {
    for (int tt = 0; tt < n; tt++) {
        rows[tt] = cache + ((int64_t)table[*blk] * block_size + *i) * row_len;
        if (++*i == block_size) { *i = 0; ++*blk; }
    }
}

/* Pages are scattered, so the hardware prefetcher loses the stream at every block boundary: ask
 * for the next group's rows while this one is computed. */
ALWAYS_INLINE void prefetch_rows(const uint16_t* const* rows, int n, int row_len) {
    for (int tt = 0; tt < n; tt++)
        for (int off = 0; off < row_len * 2; off += 64) __builtin_prefetch((const char*)rows[tt] + off, 0, 3);
}

/* The rows of the group after the one starting at t0 into `next` (prefetched); returns its size, 0 at the end. */
ALWAYS_INLINE int next_group(const uint16_t* cache, const int32_t* table, int block_size, int row_len, int ctx,
                             int t0, int* blk, int* i, const uint16_t** next) {
    const int left = ctx - t0 - 16, nn = left < 16 ? (left > 0 ? left : 0) : 16;
    if (nn) {
        group_rows(cache, table, block_size, row_len, nn, blk, i, next);
        prefetch_rows(next, nn, row_len);
    }
    return nn;
}

#define GV_MAX 8  /* query heads per V register pass: 256 / D for D >= 32 */

/* The V pass accumulates each 32-dim chunk as two vectors in unpack order (see attend_bf16):
 * lane 4L + k of the first is dim 8L + k, of the second dim 8L + 4 + k. Back to dim order. */
ALWAYS_INLINE void unpair_dims(float* acc, int n) {
    int i0[16], i1[16];
    for (int j = 0; j < 16; j++) {
        const int r = j % 8;
        i0[j] = (r < 4 ? 0 : 16) + 4 * (j / 8) + r % 4;
        i1[j] = (r < 4 ? 0 : 16) + 4 * (2 + j / 8) + r % 4;
    }
    const __m512i idx0 = _mm512_loadu_si512(i0), idx1 = _mm512_loadu_si512(i1);
    for (int c = 0; c < n; c += 32) {
        const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
        _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(lo, idx0, hi));
        _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(lo, idx1, hi));
    }
}

/* One sequence, 16 tokens at a time, each group's rows read whole (all KV heads) once per pass;
 * D % 32 == 0 and D <= 256. q, out: bf16 [H][D]. */
ALWAYS_INLINE void attend_bf16(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                               const int32_t* table, int ctx, int H, int KVH, const int D, int block_size,
                               float scale, float* restrict buf) {
    const int G = H / KVH, row_len = KVH * D, NC = D / 16, GV = 256 / D;  /* GV heads x NC chunks: 16 registers */
    float* acc = buf;        /* [H][D] */
    float* s = acc + H * D;  /* [H][ctx] */
    const uint16_t *rows[16], *next[16];
    int blk = 0, i = 0, nblk = 0, ni = 0;
    int n = ctx < 16 ? ctx : 16;
    group_rows(k_cache, table, block_size, row_len, n, &blk, &i, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group(k_cache, table, block_size, row_len, ctx, t0, &blk, &i, next);
        for (int h = 0; h < KVH; h++) {
            for (int g = 0; g < G; g++) {
                const uint16_t* qh = q + (int64_t)(h * G + g) * D;
                __m512 a[16];
                for (int tt = 0; tt < 16; tt++) {
                    __m512 dot = _mm512_setzero_ps();
                    if (tt < n)
                        for (int c = 0; c < D / 32; c++)
                            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * c),
                                                   (__m512bh)_mm512_loadu_si512(rows[tt] + h * D + 32 * c));
                    a[tt] = dot;
                }
                _mm512_mask_storeu_ps(s + (int64_t)(h * G + g) * ctx + t0, (__mmask16)((1u << n) - 1),
                                      _mm512_mul_ps(sum_each16(a), _mm512_set1_ps(scale)));
            }
        }
        for (int tt = 0; tt < nn; tt++) rows[tt] = next[tt];
        n = nn;
    }
    softmax_rows(s, H, ctx);
    memset(acc, 0, sizeof(float) * H * D);
    n = ctx < 16 ? ctx : 16;
    group_rows(v_cache, table, block_size, row_len, n, &nblk, &ni, rows);
    for (int t0 = 0; t0 < ctx; t0 += 16) {
        const int nn = next_group(v_cache, table, block_size, row_len, ctx, t0, &nblk, &ni, next);
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
                    const uint16_t* ra = rows[tt] + h * D;
                    const uint16_t* rb = tt + 1 < n ? rows[tt + 1] + h * D : ra;  /* its probability is 0 */
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
    store_row(out, 1, 0, H * D, acc, 1.f);
}

#define SPECIALISE_BF16(DIM) \
    static void attend_bf16_d##DIM(const uint16_t* q, uint16_t* out, const uint16_t* k, const uint16_t* v, \
                                   const int32_t* table, int ctx, int H, int KVH, int bs, float scale, float* buf) { \
        attend_bf16(q, out, k, v, table, ctx, H, KVH, DIM, bs, scale, buf); \
    }
SPECIALISE_BF16(64)
SPECIALISE_BF16(128)
#endif

#endif
