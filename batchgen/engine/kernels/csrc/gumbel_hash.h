/* engine/sampling/random_stream.py's counter-based noise for one (row key, token id): shared by
 * gumbel_noise.c (whole blocks of noise) and sample_draw.c (the noise of the few tokens a draw keeps).
 * The integer steps wrap in 32 or 64 bits as the Python reference does, the uniform is the same float32
 * number, and -log(-log(u)) is computed in float32 as torch computes it. */
#ifndef BATCHGEN_GUMBEL_HASH_H
#define BATCHGEN_GUMBEL_HASH_H

#include <stdint.h>
#include <math.h>

static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* random_stream.row_keys: the key of a row's draw of its output token number `position` */
static inline uint64_t row_key(int64_t seed, int64_t position) {
    return splitmix64(splitmix64((uint64_t)seed) ^ ((uint64_t)position * 0x9E3779B97F4A7C15ull));
}

/* the noise of token `id` under the key halves (lo, hi); perm(id) = lowbias32(id ^ salt) */
static inline float gumbel_value(uint32_t lo, uint32_t hi, uint32_t id, uint32_t salt, int uniform_bits) {
    const uint32_t bits = lowbias32(lowbias32(lowbias32(id ^ salt) ^ lo) ^ hi);
    const float u = ((float)(bits >> (32 - uniform_bits)) + 0.5f) * ldexpf(1.f, -uniform_bits);
    return -logf(-logf(u));
}

#endif
