/* prefill_attention.c's packs: each (sequence, KV head)'s context copied once out of the pages into
 * the layout its multiply loops read (prefill_attention.c says why).
 *   float32: K [groups of 16 keys][D][16], V rows [ctx_pad][D];
 *   bfloat16 (AVX512-BF16 CPUs): K [groups of 16 keys][D/2][16 keys][2], V [ctx_pad/2][D][2]. */
#ifndef BATCHGEN_PREFILL_PACK_H
#define BATCHGEN_PREFILL_PACK_H

#include <stdint.h>
#include <string.h>

#include "common.h"  /* ALWAYS_INLINE */

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* The cache row of token t of a sequence (all KV heads): [num_slots, KVH, D] through its block table. */
ALWAYS_INLINE int64_t slot_of(const int32_t* table, int block_size, int t) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

/* context token t's K and V rows (D values each) into that layout */
ALWAYS_INLINE void place_f32(const float* k, const float* v, int t, int D, float* kp, float* vp) {
    float* kg = kp + (int64_t)(t / 16) * D * 16 + t % 16;
    for (int d = 0; d < D; d++) kg[d * 16] = k[d];
    memcpy(vp + (int64_t)t * D, v, sizeof(float) * D);
}

/* Zero what lies past the context in both layouts (elem bytes a value), before the context is
 * placed: the last 16-key group of K and the last key pair of V may hold both. The tile loops read
 * these pad keys, whose probabilities are 0, so they must be finite. Only the tail: the context's
 * own values are all written by the placing. */
ALWAYS_INLINE void zero_past_context(void* kp, void* vp, int ctx, int ctx_pad, int D, int elem) {
    const int64_t k0 = (int64_t)(ctx / 16) * 16 * D, v0 = (int64_t)(ctx / 2) * 2 * D, end = (int64_t)ctx_pad * D;
    memset((char*)kp + k0 * elem, 0, (size_t)(end - k0) * elem);
    memset((char*)vp + v0 * elem, 0, (size_t)(end - v0) * elem);
}

static void pack_f32(const float* k_cache, const float* v_cache, const int32_t* table, int block_size, int ctx,
                     int ctx_pad, int KVH, int h, int D, float* kp, float* vp) {
    zero_past_context(kp, vp, ctx, ctx_pad, D, sizeof(float));
    for (int t = 0; t < ctx; t++) {
        const int64_t row = (slot_of(table, block_size, t) * KVH + h) * D;
        place_f32(k_cache + row, v_cache + row, t, D, kp, vp);
    }
}

#ifdef __AVX512BF16__
/* Token t's K row into its group: the D/2 bf16 pairs are 32-bit words, each to its own 16-key row. */
ALWAYS_INLINE void place_k_bf16(const uint16_t* k, int t, int D, uint16_t* kp) {
    uint16_t* kg = kp + (int64_t)(t / 16) * D * 16 + (t % 16) * 2;
    for (int d = 0; d < D; d += 2) memcpy(kg + d * 16, k + d, 4);
}

/* context token t's K and V rows (D values each) into that layout, one token at a time (the int8
 * pack, which dequantizes each row first; pack_bf16 places V two tokens at a time) */
ALWAYS_INLINE void place_bf16(const uint16_t* k, const uint16_t* v, int t, int D, uint16_t* kp, uint16_t* vp) {
    place_k_bf16(k, t, D, kp);
    uint16_t* vj = vp + (int64_t)(t / 2) * D * 2 + t % 2;
    for (int d = 0; d < D; d++) vj[d * 2] = v[d];
}

/* Two consecutive tokens' V rows (v1 NULL: a zero pad token) interleaved into their pair row, 16
 * dimensions a vector. */
ALWAYS_INLINE void place_v_pair_bf16(const uint16_t* v0, const uint16_t* v1, int t, int D, uint16_t* vp) {
    static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_loadu_si512(interleave);
    uint16_t* vj = vp + (int64_t)(t / 2) * D * 2;
    for (int c = 0; c < D; c += 16) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v0 + c)));
        const __m512i b = v1 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v1 + c)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(vj + 2 * c, _mm512_permutex2var_epi16(a, idx, b));
    }
}

static void pack_bf16(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int block_size, int ctx,
                      int ctx_pad, int KVH, int h, int D, uint16_t* kp, uint16_t* vp) {
    zero_past_context(kp, vp, ctx, ctx_pad, D, sizeof(uint16_t));
    for (int t = 0; t < ctx; t += 2) {
        const int64_t row0 = (slot_of(table, block_size, t) * KVH + h) * D;
        const int64_t row1 = t + 1 < ctx ? (slot_of(table, block_size, t + 1) * KVH + h) * D : -1;
        place_k_bf16(k_cache + row0, t, D, kp);
        if (row1 >= 0) place_k_bf16(k_cache + row1, t + 1, D, kp);
        place_v_pair_bf16(v_cache + row0, row1 >= 0 ? v_cache + row1 : NULL, t, D, vp);
    }
}
#endif

#endif
