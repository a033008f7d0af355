/* What paged_decode.c's AVX-512 paths (bf16 pages, int8 pages) share: walking a sequence's block
 * table 16 tokens at a time, prefetching the next group, and the pair order of their V passes.
 * Included under __AVX512F__. */
#ifndef BATCHGEN_PAGED_ROWS_H
#define BATCHGEN_PAGED_ROWS_H

#include <stdint.h>
#include <immintrin.h>

#include "common.h"  /* ALWAYS_INLINE */

ALWAYS_INLINE __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* The cache rows (all KV heads, row_bytes each) of tokens [t0, t0 + n) of one sequence, n <= 16;
 * *blk and *i walk its block table. */
ALWAYS_INLINE void group_rows(const char* cache, const int32_t* table, int block_size, int row_bytes, int n,
                              int* blk, int* i, const char** rows) {
    for (int tt = 0; tt < n; tt++) {
        rows[tt] = cache + ((int64_t)table[*blk] * block_size + *i) * row_bytes;
        if (++*i == block_size) { *i = 0; ++*blk; }
    }
}

/* Pages are scattered, so the hardware prefetcher loses the stream at every block boundary: ask
 * for the next group's rows while this one is computed. */
ALWAYS_INLINE void prefetch_rows(const char* const* rows, int n, int row_bytes) {
    for (int tt = 0; tt < n; tt++)
        for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(rows[tt] + off, 0, 3);
}

/* The rows of the group after the one starting at t0 into `next` (prefetched); returns its size, 0 at the end. */
ALWAYS_INLINE int next_group(const char* cache, const int32_t* table, int block_size, int row_bytes, int ctx,
                             int t0, int* blk, int* i, const char** next) {
    const int left = ctx - t0 - 16, nn = left < 16 ? (left > 0 ? left : 0) : 16;
    if (nn) {
        group_rows(cache, table, block_size, row_bytes, nn, blk, i, next);
        prefetch_rows(next, nn, row_bytes);
    }
    return nn;
}

#define GV_MAX 8  /* query heads per V register pass: 256 / D for D >= 32 */

/* The V passes multiply two tokens at a time, their rows interleaved by unpacklo/hi_epi16 into
 * (v_t[d], v_t+1[d]) pairs, and accumulate each 32-dim chunk as two vectors in that unpack order:
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

#endif
