/* A row's sampling candidates, shared by sample_window.c and sample_draw.c: reading bf16 or float32
 * logits, the 64-bit candidate keys whose ascending order is (value descending, id ascending), their
 * selection and sort, and the vectorized collection of a row's logits at or above a cut. */
#ifndef BATCHGEN_SAMPLE_ROWS_H
#define BATCHGEN_SAMPLE_ROWS_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"        /* ALWAYS_INLINE */
#include "bf16_convert.h"  /* load_one */

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_exp.h"
#include "simd_load16.h"  /* tail, load16 */

#define ALL16 ((__mmask16)0xFFFF)
#endif

/* A candidate as one 64-bit key whose ascending order is (value descending, then id ascending):
 * the value's bits made monotone and inverted above, the id below. Sorting plain integers keeps the
 * comparisons inline (qsort's callback cost more than the rest of a row). */
ALWAYS_INLINE uint64_t candidate_key(float value, int32_t id) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  /* monotone in the float's order */
    return ((uint64_t)~bits << 32) | (uint32_t)id;
}

ALWAYS_INLINE float key_value(uint64_t key) {
    uint32_t bits = ~(uint32_t)(key >> 32);
    bits = (bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

ALWAYS_INLINE void swap_keys(uint64_t* a, uint64_t* b) {
    const uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* quickselect: reorder c so that its first `count` entries are its `count` smallest keys */
static void select_first(uint64_t* c, int64_t n, int64_t count) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const uint64_t pivot = c[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (c[i] < pivot) i++;
            while (pivot < c[j]) j--;
            if (i <= j) swap_keys(&c[i++], &c[j--]);
        }
        if (count - 1 <= j) hi = j;
        else if (count - 1 >= i) lo = i;
        else break;
    }
}

/* ascending sort of the (distinct) keys: quicksort down to short runs, then insertion */
static void sort_keys(uint64_t* c, int64_t n) {
    while (n > 16) {
        const uint64_t pivot = c[n / 2];
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (c[i] < pivot) i++;
            while (pivot < c[j]) j--;
            if (i <= j) swap_keys(&c[i++], &c[j--]);
        }
        /* recurse into the shorter side, loop on the longer: the stack stays logarithmic */
        if (j + 1 < n - i) {
            sort_keys(c, j + 1);
            c += i;
            n -= i;
        } else {
            sort_keys(c + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t a = 1; a < n; a++) {
        const uint64_t key = c[a];
        int64_t b = a - 1;
        for (; b >= 0 && c[b] > key; b--) c[b + 1] = c[b];
        c[b + 1] = key;
    }
}

/* the row's logits >= cut and their ids into raw/ids (vectorized); returns how many */
static inline int64_t collect(const void* x, int bf16, int64_t n, float cut, float* raw, int32_t* ids) {
    int64_t k = 0, i = 0;
#ifdef __AVX512F__
    const __m512 vcut = _mm512_set1_ps(cut);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i, ALL16);
        const __mmask16 keep = _mm512_cmp_ps_mask(v, vcut, _CMP_GE_OQ);
        if (!keep) continue;
        _mm512_mask_compressstoreu_ps(raw + k, keep, v);
        _mm512_mask_compressstoreu_epi32(ids + k, keep, _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota));
        k += __builtin_popcount(keep);
    }
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (v >= cut) { raw[k] = v; ids[k] = (int32_t)i; k++; }
    }
    return k;
}

/* the row's logits >= cut straight into candidate keys of logit / temperature (the division
 * torch does), vectorized; returns how many */
static inline int64_t collect_keys(const void* x, int bf16, int64_t n, float cut, float temperature, uint64_t* keys) {
    int64_t k = 0, i = 0;
#ifdef __AVX512F__
    const __m512 vcut = _mm512_set1_ps(cut), vt = _mm512_set1_ps(temperature);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i, ALL16);
        const __mmask16 keep = _mm512_cmp_ps_mask(v, vcut, _CMP_GE_OQ);
        if (!keep) continue;
        const __m512i bits = _mm512_castps_si512(_mm512_div_ps(v, vt));
        /* candidate_key's high half: a negative value's bits as they are, a positive one's inverted
         * below the sign bit */
        const __mmask16 negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
        const __m512i high = _mm512_mask_mov_epi32(_mm512_andnot_si512(bits, magnitude), negative, bits);
        const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota);
        const __m512i low8 = _mm512_or_si512(
            _mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(high)), 32),
            _mm512_cvtepu32_epi64(_mm512_castsi512_si256(ids)));
        const __m512i high8 = _mm512_or_si512(
            _mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(high, 1)), 32),
            _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(ids, 1)));
        _mm512_mask_compressstoreu_epi64(keys + k, (__mmask8)keep, low8);
        k += __builtin_popcount(keep & 0xFF);
        _mm512_mask_compressstoreu_epi64(keys + k, (__mmask8)(keep >> 8), high8);
        k += __builtin_popcount(keep >> 8);
    }
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (v >= cut) keys[k++] = candidate_key(v / temperature, (int32_t)i);
    }
    return k;
}

#endif
