/* A step's whole sampled draw on the CPU, one call for every sampling row: the token that
 * engine/sampling/draw.py's window path draws (temperature, top-k, top-p, min-p, Gumbel-max with the
 * counter-based noise of engine/sampling/random_stream.py), for rows that ask for no logprobs.
 *
 * Why C: the window path pays for a sorted window of 256 candidates per row, a dozen small torch ops
 * on it and, for a truncated row whose kept set outgrows the window, a second pass at a window 8 times
 * larger; at a decode step's sizes those costs are a visible share of the step. Here each row is read
 * three times (its max; its sum of exp, with how many values and how much mass lie within each of a
 * few cuts below the max; one collection of the values above the cut that holds what the row needs),
 * and only the candidates that can be kept are sorted and hashed.
 *
 * Same token as the window path, by construction:
 *   a truncated row's kept set is a function of its values alone (draw.py's docstring), so it is the
 *       same whether found in a window of 256 or in the values above a cut: the thresholds below are
 *       the window path's, computed on the sorted values above the cut, and when the kept set may
 *       reach below the cut the row is collected again at the next one, as the window path widens;
 *   an untruncated row races the tokens strictly above the 256th largest value (`window`) and the
 *       rest as one pseudo-token, exactly as the window path does, and draws within the tail only
 *       when the pseudo-token wins.
 * Float rounding may differ from torch's in the last bits (exp, the sums' order), which can move a
 * top-p boundary only when a row's mass sits within rounding of top_p.
 * Built at first use by batchgen/engine/kernels/loader.py like the other csrc/ files.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */

#include "sample_rows.h"  /* load_one, load16, candidate keys, select_first, sort_keys, collect_keys */
#include "gumbel_hash.h"  /* row_key, gumbel_value */

/* cuts in nats (after temperature) below the row's max; past the last, the whole row is collected */
#define NUM_CUTS 9
static const float CUT_NATS[NUM_CUTS] = {2.f, 3.f, 4.f, 6.f, 8.f, 11.f, 16.f, 22.f, 32.f};
/* exp(-64) and less cannot change a float32 sum that holds the max's exp(0) = 1 */
#define NEGLIGIBLE_NATS 64.f
/* the cuts up to NEAR_CUTS - 1 hold few values: they are counted only in the blocks of 16 that hold a
 * value within the last of them, which most blocks of a row do not */
#define NEAR_CUTS 6
/* above the largest noise a 23-bit uniform gives (-log(-log(1 - 2**-24)) = 16.64): a tail token whose
 * value is more than this below the best score cannot win */
#define GUMBEL_BOUND 16.7f

typedef struct {
    float max;                 /* the row's largest logit */
    float sum;                 /* sum of exp((logit - max) / temperature) */
    int64_t within[NUM_CUTS];  /* how many logits are >= max - CUT_NATS[c] * temperature */
    float mass[NUM_CUTS];      /* their part of `sum` */
} RowStats;

static void row_stats(const void* x, int bf16, int64_t n, float temperature, RowStats* st) {
    const float inv_temperature = 1.f / temperature;
    float m = -INFINITY, s = 0.f;
    float cut[NUM_CUTS];
    int64_t i = 0;
    for (int c = 0; c < NUM_CUTS; c++) st->within[c] = 0, st->mass[c] = 0.f;
#ifdef __AVX512F__
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, load16(x, bf16, i, ALL16));
    m = _mm512_reduce_max_ps(vmax);
    for (int64_t j = i; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    for (int c = 0; c < NUM_CUTS; c++) cut[c] = m - CUT_NATS[c] * temperature;
    __m512 vcut[NUM_CUTS], vmass[NUM_CUTS];
    for (int c = 0; c < NUM_CUTS; c++) vcut[c] = _mm512_set1_ps(cut[c]), vmass[c] = _mm512_setzero_ps();
    __m512 acc = _mm512_setzero_ps();
    const __m512 vskip = _mm512_set1_ps(m - NEGLIGIBLE_NATS * temperature);
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_temperature);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, bf16, i, ALL16);
        if (!_mm512_cmp_ps_mask(v, vskip, _CMP_GE_OQ)) continue;  /* a block of negligible values */
        const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(v, vm), vt));
        acc = _mm512_add_ps(acc, e);
        for (int c = NEAR_CUTS; c < NUM_CUTS; c++) {
            const __mmask16 k = _mm512_cmp_ps_mask(v, vcut[c], _CMP_GE_OQ);
            st->within[c] += __builtin_popcount(k);
            vmass[c] = _mm512_mask_add_ps(vmass[c], k, vmass[c], e);
        }
        if (!_mm512_cmp_ps_mask(v, vcut[NEAR_CUTS - 1], _CMP_GE_OQ)) continue;
        for (int c = 0; c < NEAR_CUTS; c++) {
            const __mmask16 k = _mm512_cmp_ps_mask(v, vcut[c], _CMP_GE_OQ);
            st->within[c] += __builtin_popcount(k);
            vmass[c] = _mm512_mask_add_ps(vmass[c], k, vmass[c], e);
        }
    }
    s = _mm512_reduce_add_ps(acc);
    for (int c = 0; c < NUM_CUTS; c++) st->mass[c] = _mm512_reduce_add_ps(vmass[c]);
#else
    for (int64_t j = 0; j < n; j++) m = fmaxf(m, load_one(x, bf16, j));
    for (int c = 0; c < NUM_CUTS; c++) cut[c] = m - CUT_NATS[c] * temperature;
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i);
        const float e = expf((v - m) * inv_temperature);
        s += e;
        for (int c = 0; c < NUM_CUTS; c++)
            if (v >= cut[c]) st->within[c]++, st->mass[c] += e;
    }
    st->max = m;
    st->sum = s;
}

ALWAYS_INLINE uint32_t key_id(uint64_t key) { return (uint32_t)key; }

/* The window path's threshold (draw.py's _draw_window) on the row's k largest values, sorted in
 * `keys`; whole: they are all of its values. Returns 1 where the kept set may reach below them (the
 * window path's fallback), 0 where `threshold` is the row's. */
static int truncated_threshold(const uint64_t* keys, int64_t k, int whole, int64_t n, int64_t top_k, float top_p,
                               float min_p, float lse, float* threshold_out) {
    const int top_k_on = top_k > 0 && top_k < n;
    const float first = key_value(keys[0]), edge = key_value(keys[k - 1]);
    float threshold = -INFINITY;
    if (top_k_on) threshold = top_k <= k ? key_value(keys[top_k - 1]) : edge;
    if (top_p < 1.f) {
        float norm = lse;  /* top-p renormalized over the top-k survivors when top-k is on */
        if (top_k_on) {
            float s = 0.f;
            for (int64_t j = 0; j < k && key_value(keys[j]) >= threshold; j++) s += expf(key_value(keys[j]) - first);
            norm = first + logf(s);
        }
        /* torch's cumsum accumulates float32 in double and rounds each prefix to float32 */
        double cum = 0.0;
        int64_t num_kept = 0;
        for (int64_t j = 0; j < k; j++) {
            const float v = key_value(keys[j]);
            if (!(v >= threshold)) break;  /* the top-k survivors are a prefix */
            const float p = expf(v - norm);
            cum += p;
            const float before = (float)cum - p;
            if (before < top_p) num_kept++;
            /* the mass before a position never falls again by more than a rounding: done */
            else if (before > top_p + 1e-6f) break;
        }
        if (num_kept < 1) num_kept = 1;
        threshold = fmaxf(threshold, key_value(keys[num_kept - 1]));
    }
    if (min_p > 0.f) threshold = fmaxf(threshold, first + logf(min_p));
    *threshold_out = threshold;
    if (whole) return 0;
    return threshold <= edge || (top_k_on && top_k > k);
}

/* The first cut worth collecting at: the nearest that holds the window (an untruncated row), more
 * than top_k values, or, for top-p without top-k, a little more than top_p of the mass; or, for
 * min-p, one below its floor. NUM_CUTS: the whole row. */
static int first_cut(const RowStats* st, int untruncated, int64_t window, int64_t top_k, int top_k_on, float top_p,
                     float min_p) {
    const float min_p_nats = min_p > 0.f ? -logf(min_p) + 0.01f : INFINITY;
    for (int c = 0; c < NUM_CUTS; c++) {
        if (untruncated) {
            if (st->within[c] >= window) return c;
        } else if (top_k_on) {
            if (st->within[c] > top_k) return c;
        } else if ((top_p < 1.f && st->mass[c] >= top_p * st->sum * 1.0001f) || CUT_NATS[c] > min_p_nats) {
            return c;
        }
    }
    return NUM_CUTS;
}

typedef struct {
    uint32_t lo, hi, salt;
    int uniform_bits;
} Noise;

ALWAYS_INLINE float noise_of(const Noise* z, uint32_t id) { return gumbel_value(z->lo, z->hi, id, z->salt, z->uniform_bits); }

#ifdef __AVX512F__
ALWAYS_INLINE __m512i lowbias16(__m512i x) {  /* gumbel_hash.h's lowbias32 on 16 lanes */
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x21F0AAAD));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x735A2D97));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}
#endif

/* An untruncated row whose pseudo-token won: argmax of x + noise over its tail (x <= edge, every
 * token id, first id on ties, as torch's argmax over the vocabulary). The tail's largest collected
 * value seeds the best score, so that most of the row is skipped by the noise's bound unhashed. */
static int64_t draw_tail(const void* x, int bf16, int64_t n, float temperature, float edge, const uint64_t* keys,
                         int64_t k, const Noise* z) {
    float best = -INFINITY;
    int64_t token = -1;
    uint64_t seed_key = UINT64_MAX;  /* the largest collected tail value: its score seeds the bound */
    for (int64_t j = 0; j < k; j++)
        if (key_value(keys[j]) <= edge && keys[j] < seed_key) seed_key = keys[j];
    if (seed_key != UINT64_MAX) {
        token = key_id(seed_key);
        best = key_value(seed_key) + noise_of(z, (uint32_t)token);
    }
    int64_t i = 0;
#ifdef __AVX512F__
    /* a block whose every value lies beyond the noise's reach below the best is skipped whole: the
     * product by 1 / temperature is within rounding of the division, which the slack covers */
    const __m512 inv_temperature = _mm512_set1_ps(1.f / temperature);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16) {
        const float slack = 0.01f + fabsf(best) * 1e-5f;
        const __m512 approx = _mm512_mul_ps(load16(x, bf16, i, ALL16), inv_temperature);
        __mmask16 reach = _mm512_cmp_ps_mask(approx, _mm512_set1_ps(best - GUMBEL_BOUND - slack), _CMP_GE_OQ);
        if (!reach) continue;
        /* the lanes whose noise could lift them to the best: x + g >= best needs g >= d = best - x,
         * that is u >= exp(-exp(-d)), and u grows with the hash bits, so the hash alone (16 lanes at
         * once) rules out most of a flat row's tail; the bounds are loosened past exp16's rounding */
        const __m512i bits = lowbias16(_mm512_xor_si512(lowbias16(_mm512_xor_si512(lowbias16(
            _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32((int32_t)i), iota), _mm512_set1_epi32((int32_t)z->salt))),
            _mm512_set1_epi32((int32_t)z->lo))), _mm512_set1_epi32((int32_t)z->hi)));
        const __m512 u = _mm512_mul_ps(
            _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 32 - z->uniform_bits)), _mm512_set1_ps(0.5f)),
            _mm512_set1_ps(ldexpf(1.f, -z->uniform_bits)));
        /* exp(-exp(-d)) >= 1 - exp(-d): so 1 - u <= exp(-d) is a looser test, with one exp */
        const __m512 d = _mm512_sub_ps(_mm512_set1_ps(best - slack), approx);  /* at most best - x */
        const __m512 room = _mm512_fmadd_ps(exp16(_mm512_sub_ps(_mm512_setzero_ps(), d)), _mm512_set1_ps(1.f + 1e-5f),
                                            _mm512_set1_ps(1e-7f));
        reach &= _mm512_cmp_ps_mask(_mm512_sub_ps(_mm512_set1_ps(1.f), u), room, _CMP_LE_OQ);
        for (; reach; reach &= reach - 1) {
            const int64_t j = i + __builtin_ctz(reach);
            const float v = load_one(x, bf16, j) / temperature;
            if (!(v <= edge) || v + GUMBEL_BOUND < best) continue;
            const float score = v + noise_of(z, (uint32_t)j);
            if (score > best || (score == best && j < token)) best = score, token = j;
        }
    }
#endif
    for (; i < n; i++) {
        const float v = load_one(x, bf16, i) / temperature;
        if (!(v <= edge) || v + GUMBEL_BOUND < best) continue;
        const float score = v + noise_of(z, (uint32_t)i);
        if (score > best || (score == best && i < token)) best = score, token = i;
    }
    return best > -INFINITY ? token : -1;
}

/* An untruncated row: its `window` largest values are the first `window` keys (any order) of the k
 * collected; the tokens strictly above the smallest of them race, the rest as one pseudo-token of
 * their logsumexp with the noise of id n. */
static int64_t draw_untruncated(const void* x, int bf16, int64_t n, float temperature, float lse, uint64_t* keys,
                                int64_t k, int64_t window, const Noise* z) {
    if (k > window) select_first(keys, k, window);
    uint64_t edge_key = keys[0];
    for (int64_t j = 1; j < window; j++) edge_key = keys[j] > edge_key ? keys[j] : edge_key;
    const float edge = key_value(edge_key);
    float best = -INFINITY, share = 0.f;
    uint64_t best_key = UINT64_MAX;
    for (int64_t j = 0; j < window; j++) {
        const float v = key_value(keys[j]);
        if (!(v > edge)) continue;
        share += expf(v - lse);
        const float score = v + noise_of(z, key_id(keys[j]));
        if (score > best || (score == best && keys[j] < best_key)) best = score, best_key = keys[j];
    }
    /* a window holding -inf holds every finite value: no tail to race */
    const float tail_lse = edge == -INFINITY ? -INFINITY : lse + logf(fmaxf(1.f - share, 0.f));
    if (tail_lse > -INFINITY && (best_key == UINT64_MAX || tail_lse + noise_of(z, (uint32_t)n) > best)) {
        const int64_t token = draw_tail(x, bf16, n, temperature, edge, keys, k, z);
        if (token >= 0) return token;  /* else the tail's mass was a rounding of the window's share */
    }
    if (best_key == UINT64_MAX)  /* nothing above the edge and no tail: the window's first, as torch's max */
        for (int64_t j = 0; j < window; j++) best_key = keys[j] < best_key ? keys[j] : best_key;
    return key_id(best_key);
}

typedef struct {
    uint64_t* keys;  /* a row's candidates */
    int64_t capacity;
} Scratch;

/* each thread keeps its buffers between calls: a step's rows reuse them, and no call maps fresh pages */
static __thread Scratch thread_scratch;

static int reserve(Scratch* sc, int64_t n) {
    if (sc->capacity >= n) return 1;
    free(sc->keys);
    sc->keys = (uint64_t*)malloc((size_t)n * sizeof(uint64_t));
    sc->capacity = sc->keys ? n : 0;
    return sc->capacity > 0;
}

static int64_t draw_row(const void* x, int bf16, int64_t n, float temperature, int64_t top_k, float top_p,
                        float min_p, const Noise* z, int64_t window, Scratch* sc) {
    const int top_k_on = top_k > 0 && top_k < n;
    const int untruncated = !top_k_on && !(top_p < 1.f) && !(min_p > 0.f);
    RowStats st;
    row_stats(x, bf16, n, temperature, &st);
    if (st.max == -INFINITY) return 0;  /* nothing allowed: the window path's first id, as its argmax */
    const float lse = st.max / temperature + logf(st.sum);
    int c = first_cut(&st, untruncated, window, top_k, top_k_on, top_p, min_p);
    if (untruncated && window >= n) c = NUM_CUTS;  /* a window of the whole row keeps every token */
    int retried = 0;
    for (;; c++) {
        int64_t k = collect_keys(x, bf16, n, c < NUM_CUTS ? st.max - CUT_NATS[c] * temperature : -INFINITY,
                                 temperature, sc->keys);
        if (untruncated && window < n) return draw_untruncated(x, bf16, n, temperature, lse, sc->keys, k, window, z);
        /* top-k keeps at most its k largest and their ties: sort a margin beyond them, not the cut's all
         * (ties past the margin make the threshold reach its edge: the next cut sorts everything) */
        int64_t sorted = k;
        if (top_k_on && !retried && c < NUM_CUTS && k > 2 * top_k + 32) {
            sorted = 2 * top_k + 32;
            select_first(sc->keys, k, sorted);
        }
        sort_keys(sc->keys, sorted);
        float threshold;
        if (truncated_threshold(sc->keys, sorted, sorted == n, n, top_k, top_p, min_p, lse, &threshold)
            && c < NUM_CUTS) {
            retried = 1;
            continue;  /* the kept set may reach below what was sorted: the next cut */
        }
        k = sorted;
        float best = -INFINITY;
        int64_t token = key_id(sc->keys[0]);
        for (int64_t j = 0; j < k; j++) {
            const float v = key_value(sc->keys[j]);
            if (!(v >= threshold)) break;  /* the kept set is a prefix */
            const float score = v + noise_of(z, key_id(sc->keys[j]));
            if (score > best) best = score, token = key_id(sc->keys[j]);
        }
        return token;
    }
}

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16; per row:
 * temperature (> 0), top_k (0 = off), top_p (1 = off), min_p (0 = off), seed and output position;
 * window: the untruncated rows' race (draw.py's window); salt, uniform_bits: random_stream's.
 * out: [rows] token ids; -1 in a row whose scratch could not be allocated. */
void sample_draw(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* min_p, const int64_t* seeds,
                 const int64_t* positions, int64_t window, uint32_t salt, int uniform_bits, int64_t* out,
                 int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        Scratch* sc = &thread_scratch;
        if (!reserve(sc, cols)) {
            out[r] = -1;
            continue;
        }
        const uint64_t key = row_key(seeds[r], positions[r]);
        const Noise z = {(uint32_t)key, (uint32_t)(key >> 32), salt, uniform_bits};
        out[r] = draw_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols, temperature[r], top_k[r], top_p[r],
                          min_p[r], &z, window, sc);
    }
}
