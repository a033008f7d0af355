/* prefill_attention.c's packs for int8 pages (--kv-cache-dtype int8, engine/kv/quant.py: int8
 * values [num_slots, KVH, D] and one bf16 scale per token and KV head, [num_slots, KVH]), into the
 * layouts of prefill_pack.h.
 *
 * Each context row is dequantized into the query dtype as it is packed, so the score and output
 * loops run unchanged and read exactly the values the torch paths read: kv_quant.dequantize is
 * `q.to(dtype) * scale.to(dtype)`, which for float32 is the f32 product and for bfloat16 the same
 * f32 product (exact: 8 x 8 significant bits) rounded to bf16, nearest even. The pack touches each
 * context value once per (sequence, KV head), where the tile loops read it once per query row, so
 * dequantizing there is a small share of the work, and no dequantized copy of the cache is made
 * (the SDPA fallback gathers and dequantizes every chunk's whole context per layer). */
#ifndef BATCHGEN_PREFILL_PACK_INT8_H
#define BATCHGEN_PREFILL_PACK_INT8_H

#include <stdint.h>
#include <string.h>

#include "common.h"        /* ALWAYS_INLINE */
#include "bf16_convert.h"  /* bf16_to_f32, f32_to_bf16 */
#include "prefill_pack.h"  /* slot_of, place_f32, place_bf16 */

#define MAX_D 128 /* the largest head size the kernel has (prefill_attention_supports) */

/* The scale of token slot's KV head h as f32 (exact: a bf16 widened). */
ALWAYS_INLINE float int8_scale(const uint16_t* scales, int64_t slot, int KVH, int h) {
    return bf16_to_f32(scales[slot * KVH + h]);
}

static void pack_int8_f32(const int8_t* k_cache, const int8_t* v_cache, const uint16_t* k_scales,
                          const uint16_t* v_scales, const int32_t* table, int block_size, int ctx, int ctx_pad,
                          int KVH, int h, int D, float* kp, float* vp) {
    float k[MAX_D], v[MAX_D];
    zero_past_context(kp, vp, ctx, ctx_pad, D, sizeof(float));
    for (int t = 0; t < ctx; t++) {
        const int64_t slot = slot_of(table, block_size, t), row = (slot * KVH + h) * D;
        const float ks = int8_scale(k_scales, slot, KVH, h), vs = int8_scale(v_scales, slot, KVH, h);
        for (int d = 0; d < D; d++) {
            k[d] = (float)k_cache[row + d] * ks;
            v[d] = (float)v_cache[row + d] * vs;
        }
        place_f32(k, v, t, D, kp, vp);
    }
}

#ifdef __AVX512BF16__
static void pack_int8_bf16(const int8_t* k_cache, const int8_t* v_cache, const uint16_t* k_scales,
                           const uint16_t* v_scales, const int32_t* table, int block_size, int ctx, int ctx_pad,
                           int KVH, int h, int D, uint16_t* kp, uint16_t* vp) {
    uint16_t k[MAX_D], v[MAX_D];
    zero_past_context(kp, vp, ctx, ctx_pad, D, sizeof(uint16_t));
    for (int t = 0; t < ctx; t++) {
        const int64_t slot = slot_of(table, block_size, t), row = (slot * KVH + h) * D;
        const float ks = int8_scale(k_scales, slot, KVH, h), vs = int8_scale(v_scales, slot, KVH, h);
        for (int d = 0; d < D; d++) {
            k[d] = f32_to_bf16((float)k_cache[row + d] * ks);
            v[d] = f32_to_bf16((float)v_cache[row + d] * vs);
        }
        place_bf16(k, v, t, D, kp, vp);
    }
}
#endif

#endif /* BATCHGEN_PREFILL_PACK_INT8_H */
