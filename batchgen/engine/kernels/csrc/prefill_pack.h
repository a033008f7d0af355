/* prefill_attention.c's packs: each (sequence, KV head)'s context copied once out of the pages into
 * the layout its multiply loops read (prefill_attention.c says why).
 *   float32: K [groups of 16 keys][D][16], V rows [ctx_pad][D];
 *   bfloat16 (AVX512-BF16 CPUs): K [groups of 16 keys][D/2][16 keys][2], V [ctx_pad/2][D][2]. */
#ifndef BATCHGEN_PREFILL_PACK_H
#define BATCHGEN_PREFILL_PACK_H

#include <stdint.h>
#include <string.h>

#include "common.h"  /* ALWAYS_INLINE */

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

static void pack_f32(const float* k_cache, const float* v_cache, const int32_t* table, int block_size, int ctx,
                     int ctx_pad, int KVH, int h, int D, float* kp, float* vp) {
    memset(kp, 0, sizeof(float) * ctx_pad * D);
    memset(vp, 0, sizeof(float) * ctx_pad * D);
    for (int t = 0; t < ctx; t++) {
        const int64_t row = (slot_of(table, block_size, t) * KVH + h) * D;
        place_f32(k_cache + row, v_cache + row, t, D, kp, vp);
    }
}

#ifdef __AVX512BF16__
/* context token t's K and V rows (D values each) into that layout */
ALWAYS_INLINE void place_bf16(const uint16_t* k, const uint16_t* v, int t, int D, uint16_t* kp, uint16_t* vp) {
    uint16_t* kg = kp + (int64_t)(t / 16) * D * 16 + (t % 16) * 2;
    for (int d = 0; d < D; d += 2) {
        kg[d * 16] = k[d];
        kg[d * 16 + 1] = k[d + 1];
    }
    uint16_t* vj = vp + (int64_t)(t / 2) * D * 2 + t % 2;
    for (int d = 0; d < D; d++) vj[d * 2] = v[d];
}

static void pack_bf16(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int block_size, int ctx,
                      int ctx_pad, int KVH, int h, int D, uint16_t* kp, uint16_t* vp) {
    memset(kp, 0, sizeof(uint16_t) * ctx_pad * D);
    memset(vp, 0, sizeof(uint16_t) * ctx_pad * D);
    for (int t = 0; t < ctx; t++) {
        const int64_t row = (slot_of(table, block_size, t) * KVH + h) * D;
        place_bf16(k_cache + row, v_cache + row, t, D, kp, vp);
    }
}
#endif

#endif
