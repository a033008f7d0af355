/* Paged decode attention for the CPU: each sequence's one query token attends over its context
 * read in place from the paged KV cache, so no step copies ("gathers") the context first.
 *
 * Why C: on a CPU the torch path (index_select of every block, then SDPA) moves each byte of K/V
 * three times and its SDPA is not built for one-row queries, so its cost grows with context length
 * far faster than the bytes read. The work is memory-bound, so
 * the layout matters: one item is one sequence with all its heads, reading each token's K (or V)
 * row for every KV head as one contiguous run, K in one pass, V in a second.
 *
 * Built at first use by batchgen/engine/kernels/loader.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; OpenMP resolves to the libgomp torch already loaded, so the two share threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "common.h"        /* ALWAYS_INLINE, the dtype codes */
#include "bf16_convert.h"  /* bf16_to_f32 */
#include "paged_decode_common.h"  /* Rules, softmax_rows, store_row */

ALWAYS_INLINE void load_row(const void* base, int is_bf16, int64_t offset, int n, float* restrict dst) {
    if (is_bf16 == DTYPE_I8) {  /* the raw int8 values; their scales are applied outside the d loops */
        const int8_t* src = (const int8_t*)base + offset;
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
    } else if (!is_bf16) {
        memcpy(dst, (const float*)base + offset, sizeof(float) * n);
    } else {
        const uint16_t* src = (const uint16_t*)base + offset;
        uint32_t* restrict out = (uint32_t*)dst;  /* bf16 is the top half of a float32 */
        for (int i = 0; i < n; i++) out[i] = ((uint32_t)src[i]) << 16;
    }
}

/* Pages are scattered, so the hardware prefetcher loses the stream at every block boundary:
 * while one block is read, ask for the same token row of the next block. */
ALWAYS_INLINE void prefetch_row(const void* base, int is_bf16, int64_t offset, int n) {
    const int elem = is_bf16 == DTYPE_I8 ? 1 : is_bf16 ? 2 : 4;
    const char* p = (const char*)base + offset * elem;
    const int bytes = n * elem;
    for (int i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* One sequence, all heads. D is a compile-time constant in the specialised callers below, so the
 * dot products unroll into a few vector FMAs and a short reduction. */
ALWAYS_INLINE float kv_scale(const uint16_t* scales, int64_t slot, int KVH, int h) {
    /* int8 pages: one bf16 scale per token and KV head, [num_slots, num_kv_heads] */
    return bf16_to_f32(scales[slot * KVH + h]);
}

ALWAYS_INLINE void attend_one(const void* q, void* out, int q_bf16, const void* k_cache, const void* v_cache,
                              int kv_bf16, const uint16_t* k_scales, const uint16_t* v_scales,
                              const int32_t* table, int ctx, int b, int H, int KVH, const int D,
                              int block_size, float scale, const Rules* rules, float* restrict buf) {
    const int G = H / KVH, row_len = KVH * D;
    float* qf = buf;                   /* [H][D] */
    float* acc = qf + H * D;           /* [H][D] */
    float* row = acc + H * D;          /* [KVH * D] one token's K or V, all heads */
    float* s = row + row_len;          /* [H][ctx] scores, then probabilities */
    load_row(q, q_bf16, (int64_t)b * H * D, H * D, qf);
    for (int t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
        const int64_t slot0 = (int64_t)table[blk] * block_size;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const int64_t next0 = t0 + block_size < ctx ? (int64_t)table[blk + 1] * block_size : -1;
        for (int i = 0; i < n; i++) {
            if (next0 >= 0) prefetch_row(k_cache, kv_bf16, (next0 + i) * row_len, row_len);
            load_row(k_cache, kv_bf16, (slot0 + i) * row_len, row_len, row);
            for (int hq = 0; hq < H; hq++) {
                const float* kh = row + (hq / G) * D;
                const float* qh = qf + hq * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
                const float ks = kv_bf16 == DTYPE_I8 ? kv_scale(k_scales, slot0 + i, KVH, hq / G) : 1.f;
                s[hq * ctx + t0 + i] = dot * (scale * ks);
            }
        }
    }
    softmax_rows(s, H, ctx, rules);
    memset(acc, 0, sizeof(float) * H * D);
    for (int t0 = 0, blk = 0; t0 < ctx; t0 += block_size, blk++) {
        const int64_t slot0 = (int64_t)table[blk] * block_size;
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const int64_t next0 = t0 + block_size < ctx ? (int64_t)table[blk + 1] * block_size : -1;
        for (int i = 0; i < n; i++) {
            if (next0 >= 0) prefetch_row(v_cache, kv_bf16, (next0 + i) * row_len, row_len);
            load_row(v_cache, kv_bf16, (slot0 + i) * row_len, row_len, row);
            for (int hq = 0; hq < H; hq++) {
                const float vs = kv_bf16 == DTYPE_I8 ? kv_scale(v_scales, slot0 + i, KVH, hq / G) : 1.f;
                const float p = s[hq * ctx + t0 + i] * vs;
                const float* vh = row + (hq / G) * D;
                float* ah = acc + hq * D;
                for (int d = 0; d < D; d++) ah[d] += p * vh[d];
            }
        }
    }
    store_row(out, q_bf16, (int64_t)b * H * D, H * D, acc, 1.f);
}

#include "paged_decode_bf16.h"  /* the AVX512-BF16 path: HAVE_BF16_PATH, attend_bf16_d64/_d128 */
#include "paged_decode_f32.h"  /* the AVX-512 float32 path: HAVE_F32_PATH, attend_f32_d64/_d128 */
#include "paged_decode_int8.h"  /* the AVX512-VNNI path over int8 pages: HAVE_INT8_PATH, attend_int8_d32.._d256 */

#define ATTEND(QB, KB, DIM) attend_one(q, out, QB, k, v, KB, ks, vs, table, ctx, b, H, KVH, DIM, bs, scale, rules, buf)
#define SPECIALISE(DIM) \
    static void attend_d##DIM(const void* q, void* out, int q_bf16, const void* k, const void* v, int kv_bf16, \
                              const uint16_t* ks, const uint16_t* vs, const int32_t* table, int ctx, int b, \
                              int H, int KVH, int bs, float scale, const Rules* rules, float* buf) { \
        if (q_bf16) { if (kv_bf16 == DTYPE_I8) ATTEND(DTYPE_BF16, DTYPE_I8, DIM); \
                      else if (kv_bf16) ATTEND(DTYPE_BF16, DTYPE_BF16, DIM); else ATTEND(DTYPE_BF16, DTYPE_F32, DIM); } \
        else { if (kv_bf16 == DTYPE_I8) ATTEND(DTYPE_F32, DTYPE_I8, DIM); \
               else if (kv_bf16) ATTEND(DTYPE_F32, DTYPE_BF16, DIM); else ATTEND(DTYPE_F32, DTYPE_F32, DIM); } \
    }
SPECIALISE(64)
SPECIALISE(128)
static void attend_any(const void* q, void* out, int q_bf16, const void* k, const void* v, int kv_bf16,
                       const uint16_t* ks, const uint16_t* vs, const int32_t* table, int ctx, int b, int H, int KVH,
                       int D, int bs, float scale, const Rules* rules, float* buf) {
    attend_one(q, out, q_bf16, k, v, kv_bf16, ks, vs, table, ctx, b, H, KVH, D, bs, scale, rules, buf);
}

/* Decode attention straight from the paged cache (no gather): one query token per sequence.
 * q, out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_slots, num_kv_heads, head_dim];
 * block_tables: [num_seqs, max_blocks_per_seq]; dtypes: common.h's DTYPE_F32, DTYPE_BF16, DTYPE_I8 (KV only, with
 * k_scales, v_scales: bf16 [num_slots, num_kv_heads]; NULL otherwise). The layer's rules:
 * sliding_window > 0 keeps the last sliding_window keys of each context (the query's own included,
 * transformers' i - window < j <= i), softcap > 0 squashes scores, sinks [num_heads] float32 or NULL.
 * Returns 0, or nonzero when scratch memory could not be allocated. */
int paged_decode_attention(const void* q, void* out, int q_dtype, const void* k_cache, const void* v_cache,
                           int kv_dtype, const int32_t* block_tables, int max_blocks_per_seq,
                           const int32_t* context_lens, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, int num_threads,
                           const uint16_t* k_scales, const uint16_t* v_scales, int sliding_window,
                           float softcap, const float* sinks) {
    int failed = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int b = 0; b < num_seqs; b++) {
        /* a window starts the walk at the block holding its first key; the keys before it in that
         * block are the rules' lead, masked by the softmax */
        const int full_ctx = context_lens[b];
        const int first = sliding_window > 0 && full_ctx > sliding_window ? full_ctx - sliding_window : 0;
        const int skipped_blocks = first / block_size, ctx = full_ctx - skipped_blocks * block_size;
        const Rules rule = {first - skipped_blocks * block_size, softcap, sinks}, *rules = &rule;
        size_t floats = (size_t)num_heads * head_dim * 2 + (size_t)num_kv_heads * head_dim
                        + (size_t)num_heads * ctx;
#ifdef HAVE_INT8_PATH
        const int int8_path = q_dtype == DTYPE_BF16 && kv_dtype == DTYPE_I8 && int8_path_supports(head_dim);
        if (int8_path) floats = int8_scratch_floats(num_heads, head_dim, ctx);
#endif
        float* buf = (float*)malloc(sizeof(float) * floats);
        if (!buf) { failed = 1; continue; }
        const int32_t* table = block_tables + (int64_t)b * max_blocks_per_seq + skipped_blocks;
#ifdef HAVE_BF16_PATH
        if (q_dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16 && (head_dim == 64 || head_dim == 128)) {
            const uint16_t *qb = (const uint16_t*)q + (int64_t)b * num_heads * head_dim, *kb = k_cache, *vb = v_cache;
            uint16_t* ob = (uint16_t*)out + (int64_t)b * num_heads * head_dim;
            if (head_dim == 64) attend_bf16_d64(qb, ob, kb, vb, table, ctx, num_heads, num_kv_heads, block_size, scale, rules, buf);
            else attend_bf16_d128(qb, ob, kb, vb, table, ctx, num_heads, num_kv_heads, block_size, scale, rules, buf);
            free(buf);
            continue;
        }
#endif
#ifdef HAVE_INT8_PATH
        if (int8_path) {
            const uint16_t* qb = (const uint16_t*)q + (int64_t)b * num_heads * head_dim;
            uint16_t* ob = (uint16_t*)out + (int64_t)b * num_heads * head_dim;
            void (*attend)(const uint16_t*, uint16_t*, const int8_t*, const int8_t*, const uint16_t*,
                           const uint16_t*, const int32_t*, int, int, int, int, float, const Rules*, float*) =
                head_dim == 32 ? attend_int8_d32 : head_dim == 64 ? attend_int8_d64 : head_dim == 96 ? attend_int8_d96
                : head_dim == 128 ? attend_int8_d128 : attend_int8_d256;
            attend(qb, ob, k_cache, v_cache, k_scales, v_scales, table, ctx, num_heads, num_kv_heads, block_size,
                   scale, rules, buf);
            free(buf);
            continue;
        }
#endif
#ifdef HAVE_F32_PATH
        if (q_dtype == DTYPE_F32 && kv_dtype == DTYPE_F32 && (head_dim == 64 || head_dim == 128)) {
            const float *qf = (const float*)q + (int64_t)b * num_heads * head_dim;
            float* of = (float*)out + (int64_t)b * num_heads * head_dim;
            if (head_dim == 64) attend_f32_d64(qf, of, k_cache, v_cache, table, ctx, num_heads, num_kv_heads, block_size, scale, rules, buf);
            else attend_f32_d128(qf, of, k_cache, v_cache, table, ctx, num_heads, num_kv_heads, block_size, scale, rules, buf);
            free(buf);
            continue;
        }
#endif
        if (head_dim == 64)
            attend_d64(q, out, q_dtype, k_cache, v_cache, kv_dtype, k_scales, v_scales, table, ctx, b, num_heads,
                       num_kv_heads, block_size, scale, rules, buf);
        else if (head_dim == 128)
            attend_d128(q, out, q_dtype, k_cache, v_cache, kv_dtype, k_scales, v_scales, table, ctx, b, num_heads,
                       num_kv_heads, block_size, scale, rules, buf);
        else
            attend_any(q, out, q_dtype, k_cache, v_cache, kv_dtype, k_scales, v_scales, table, ctx, b, num_heads,
                       num_kv_heads, head_dim, block_size, scale, rules, buf);
        free(buf);
    }
    return failed;
}
