/* bfloat16 <-> float32 for one value, shared by the csrc/ files (a bf16 is the top half of a
 * float32). */
#ifndef BATCHGEN_BF16_CONVERT_H
#define BATCHGEN_BF16_CONVERT_H

#include <stdint.h>
#include <string.h>

#include "common.h"  /* ALWAYS_INLINE */

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* element i of a row of float32, or of bfloat16 when bf16 */
ALWAYS_INLINE float load_one(const void* x, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

/* round to nearest even, NaN kept NaN: torch's .to(torch.bfloat16) */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#endif
