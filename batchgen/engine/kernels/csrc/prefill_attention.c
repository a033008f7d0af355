/* Causal prefill attention for the CPU: each prefill sequence's new tokens (a whole prompt or a
 * chunk of one after a cached past) attend over their context read from the paged KV cache.
 *
 * Why C: torch's CPU SDPA (flash kernel) runs these shapes (head_dim 64, GQA, 256-2048 tokens)
 * far below the rate the same CPU's bf16 matmuls reach, which made prefill attention a large share
 * of a summarization job's time; and a chunk with a cached past first had to copy
 * ("gather") its context out of the pages. Here:
 *   1. each (sequence, KV head)'s context is packed once from the pages into the layout the
 *      multiply instructions read: for bf16 the AVX512-BF16 pair layout (vdpbf16ps multiplies
 *      bf16 pairs and accumulates in f32), for f32 K transposed in 16-key groups; int8 pages
 *      (with their per-token scales) are dequantized into the query's dtype there
 *      (prefill_pack_int8.h), so the loops below never see them;
 *   2. one work item is (sequence, KV head, tile of query positions): the tile's rows are every
 *      query head of that KV head at each position (GQA shares K/V without copies), its scores
 *      against the causal prefix are computed in registers, softmaxed in f32 and multiplied by V.
 * Scores stay whole per tile (rows x context in f32, L2-sized for prompts up to a few thousand
 * tokens), so the softmax is exact two-pass, as the decode kernel's, not an online rescaling.
 *
 * Built at first use by batchgen/engine/kernels/loader.py like paged_decode.c; only AVX-512 machines get
 * it (prefill_attention_supports says which dtypes), others keep the torch path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_exp.h"

/* query rows per block: the score micro kernel keeps MR x 2 key vectors of accumulators (16 of
 * the 32 registers); the output one OR(D) x D/16 (at most 16) and runs MR / OR(D) times a block */
#define MR 8
#define OR(D) ((D) <= 64 ? 4 : 2)

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

#include "bf16_convert.h"  /* bf16_to_f32, f32_to_bf16 */
#include "prefill_pack.h"  /* slot_of, pack_f32, pack_bf16: the context packed as the loops read it */

/* A layer's score rules (batchgen/engine/score_rules.py, ScoreRules). */
typedef struct {
    int window;          /* > 0: position p sees keys (p - window, p] (transformers' sliding window) */
    float softcap;       /* > 0: scores -> tanh(scores / softcap) * softcap (Gemma 2) */
    const float* sinks;  /* [H] or NULL: one logit per query head in its softmax denominator (gpt-oss) */
} Rules;

/* Lanes t .. t + 15 that lie in [lo, n). */
ALWAYS_INLINE __mmask16 lanes_in(int t, int lo, int n) {
    const uint32_t below_n = t >= n ? 0 : n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1;
    const uint32_t from_lo = t + 16 <= lo ? 0 : t >= lo ? 0xFFFF : 0xFFFF & ~((1u << (lo - t)) - 1);
    return (__mmask16)(below_n & from_lo);
}

/* Scores of one tile's softmax: row m (at query position pos[m], query head h0 + m % G) keeps keys
 * [lo, pos[m]], lo the window's first key (0 without one): scores in, probabilities out (in place,
 * or as bf16 into p16 when it is not NULL), zero outside those keys up to len (a multiple of 16).
 * Softcapping squashes the kept scores first; a sink joins each row's max and denominator. */
ALWAYS_INLINE void causal_softmax(float* s, uint16_t* p16, int rows, int64_t stride, const int* pos, int len,
                                  const Rules* r, int h0, int G) {
    for (int m = 0; m < rows; m++) {
        float* sm = s + m * stride;
        const int n = pos[m] + 1, lo = r->window > 0 && n > r->window ? n - r->window : 0;
        if (r->softcap > 0.f) {
            const float cap = r->softcap, inv_cap = 1.f / r->softcap;
            for (int t = lo; t < n; t++) sm[t] = tanhf(sm[t] * inv_cap) * cap;
        }
        __m512 vm = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
        for (int t = lo & ~15; t < n; t += 16) {
            const __mmask16 k = lanes_in(t, lo, n);
            vm = _mm512_mask_max_ps(vm, k, vm, _mm512_maskz_loadu_ps(k, sm + t));
        }
        float row_max = _mm512_reduce_max_ps(vm);
        const float sink = r->sinks ? r->sinks[h0 + m % G] : 0.f;
        if (r->sinks && sink > row_max) row_max = sink;
        const __m512 mx = _mm512_set1_ps(row_max);
        /* the 16-key groups that hold this row's keys; the tile's later rows see up to len, this
         * one's probabilities past its own position (and before its window) are zeros */
        const int t0 = lo & ~15, t1 = (n + 15) & ~15;
        for (int t = t0; t < t1; t += 16) {
            const __mmask16 k = lanes_in(t, lo, n);
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(sm + t), mx)));
            _mm512_storeu_ps(sm + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        const float sum = _mm512_reduce_add_ps(vsum) + (r->sinks ? expf(sink - row_max) : 0.f);
        const __m512 inv = _mm512_set1_ps(1.f / sum);
#ifdef __AVX512BF16__
        if (p16) {
            uint16_t* pm = p16 + m * stride;
            memset(pm, 0, sizeof(uint16_t) * t0);
            for (int t = t0; t < t1; t += 16)
                _mm256_storeu_si256((__m256i*)(pm + t),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sm + t), inv)));
            memset(pm + t1, 0, sizeof(uint16_t) * (len - t1));
            continue;
        }
#endif
        memset(sm, 0, sizeof(float) * t0);
        for (int t = t0; t < t1; t += 16) _mm512_storeu_ps(sm + t, _mm512_mul_ps(_mm512_loadu_ps(sm + t), inv));
        memset(sm + t1, 0, sizeof(float) * (len - t1));
    }
}

/* ---- float32: K packed [groups of 16 keys][D][16], V rows [ctx_pad][D] ---- */

/* s[m][j] = scale * q[m] . k[j] for MR rows and 32 keys (2 groups) */
ALWAYS_INLINE void scores_f32(const float* q, int D, const float* kp, int g, int ngroups, float* s, int64_t stride,
                              float scale) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* k0 = kp + (int64_t)g * D * 16;
    const int two = g + 1 < ngroups;
    for (int d = 0; d < D; d++) {
        const __m512 ka = _mm512_loadu_ps(k0 + d * 16);
        const __m512 kb = two ? _mm512_loadu_ps(k0 + D * 16 + d * 16) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const __m512 qa = _mm512_set1_ps(q[r * D + d]);
            acc[r][0] = _mm512_fmadd_ps(qa, ka, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(qa, kb, acc[r][1]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(s + r * stride + g * 16, _mm512_mul_ps(acc[r][0], sc));
        if (two) _mm512_storeu_ps(s + r * stride + g * 16 + 16, _mm512_mul_ps(acc[r][1], sc));
    }
}

/* o[m] = sum_j p[m][j] v[j] over j0 <= j < n for OR(D) rows (the probabilities before j0 are 0) */
ALWAYS_INLINE void output_f32(const float* p, int64_t stride, const float* vp, int j0, int n, const int D, float* o) {
    enum { R = 4 };
    __m512 acc[R][8];
    const int NC = D / 16, NR = OR(D);
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = j0; j < n; j++) {
        for (int c = 0; c < NC; c++) {
            const __m512 v = _mm512_loadu_ps(vp + (int64_t)j * D + 16 * c);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + j]), v, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

#ifdef __AVX512BF16__
/* ---- bfloat16: K packed [groups of 16 keys][D/2][16 keys][2], V packed [ctx_pad/2][D][2] ---- */
#define HAVE_BF16 1

ALWAYS_INLINE __m512bh bcast_pair(const uint16_t* p) {
    int32_t x;
    memcpy(&x, p, 4);
    return (__m512bh)_mm512_set1_epi32(x);
}

ALWAYS_INLINE void scores_bf16(const uint16_t* q, int D, const uint16_t* kp, int g, int ngroups, float* s,
                               int64_t stride, float scale) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* k0 = kp + (int64_t)g * D * 16;
    const int two = g + 1 < ngroups;
    for (int d = 0; d < D; d += 2) {
        const __m512bh ka = (__m512bh)_mm512_loadu_si512(k0 + d * 16);
        const __m512bh kb = two ? (__m512bh)_mm512_loadu_si512(k0 + D * 16 + d * 16) : (__m512bh)_mm512_setzero_si512();
        for (int r = 0; r < MR; r++) {
            const __m512bh qa = bcast_pair(q + r * D + d);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qa, ka);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qa, kb);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(s + r * stride + g * 16, _mm512_mul_ps(acc[r][0], sc));
        if (two) _mm512_storeu_ps(s + r * stride + g * 16 + 16, _mm512_mul_ps(acc[r][1], sc));
    }
}

/* p: bf16 probabilities [MR][stride], keys [j0, n) (both even; the pad key's probability is 0) */
ALWAYS_INLINE void output_bf16(const uint16_t* p, int64_t stride, const uint16_t* vp, int j0, int n, const int D,
                               float* o) {
    enum { R = 4 };
    __m512 acc[R][8];
    const int NC = D / 16, NR = OR(D);
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int j = j0; j < n; j += 2) {
        for (int c = 0; c < NC; c++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + (int64_t)j * D + 32 * c);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], bcast_pair(p + r * stride + j), v);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}
#endif /* __AVX512BF16__ */

#include "prefill_pack_int8.h" /* int8 pages dequantized as they are packed: pack_int8_* */

/* One work item: KV head h of sequence b, query positions [i0, i1) of its new tokens. */
typedef struct {
    int b, h, i0, i1;
} Item;

/* Query positions a tile of sequence context ctx: at most 96 rows (G per position), fewer for long
 * contexts so that the tile's f32 scores and bf16 probabilities (6 bytes a key a row) stay within
 * TILE_BYTES, half of a core's L2 on current x86 server parts. */
#define TILE_BYTES (512 * 1024)
static int tile_positions(int G, int ctx) {
    int rows = TILE_BYTES / (6 * (ctx > 16 ? ctx : 16));
    rows = rows > 96 ? 96 : rows < MR ? MR : rows;
    const int t = rows / G;
    return t < 1 ? 1 : t;
}

/* Everything one item needs from the call. */
typedef struct {
    const void* q;
    void* out;
    int dtype, H, KVH, G, elem;
    const int32_t *q_starts, *num_new, *context_lens;
    const char* packed;
    const int64_t* pack_off;
    float scale;
    Rules rules;
} Call;

/* One item, D a compile-time constant in the specialised callers below. Returns nonzero when its
 * scratch could not be allocated. */
ALWAYS_INLINE int attend_item(const Call* c, Item w, const int D) {
    const int G = c->G, elem = c->elem, bf16 = c->dtype == DTYPE_BF16;
    const int ctx = c->context_lens[w.b], past = ctx - c->num_new[w.b];
    const int kend = past + w.i1;  /* keys this tile needs: the causal prefix of its last position */
    const int ngroups = (kend + 15) / 16, len = ngroups * 16;
    const int rows = (w.i1 - w.i0) * G, rows_pad = (int)round_up(rows, MR);
    const int64_t stride = round_up(len, 32);
    /* scratch: q tile [rows_pad][D] (dtype), scores [rows_pad][stride] f32, bf16 probabilities,
     * output tile [rows_pad][D] f32, positions [rows_pad] */
    const size_t bytes = (size_t)rows_pad * D * elem + (size_t)rows_pad * stride * 4 + (size_t)rows_pad * stride * 2
                         + (size_t)rows_pad * D * 4 + (size_t)rows_pad * sizeof(int) + 256;
    char* buf = (char*)malloc(bytes);
    if (!buf) return 1;
    char* qt = buf;
    float* s = (float*)(qt + round_up((int64_t)rows_pad * D * elem, 64));
    uint16_t* p16 = (uint16_t*)(s + rows_pad * stride);
    float* o = (float*)((char*)p16 + round_up((int64_t)rows_pad * stride * 2, 64));
    int* pos = (int*)(o + rows_pad * D);
    /* row m = (position i - i0) * G + g: the G query heads of KV head h at each position */
    memset(qt, 0, (size_t)rows_pad * D * elem);
    for (int m = 0; m < rows_pad; m++) {
        const int i = w.i0 + (m < rows ? m / G : (rows - 1) / G);
        pos[m] = past + i;
        if (m >= rows) continue;
        const int64_t src = ((int64_t)(c->q_starts[w.b] + i) * c->H + w.h * G + m % G) * D;
        memcpy(qt + (int64_t)m * D * elem, (const char*)c->q + src * elem, (size_t)D * elem);
    }
    const int64_t ctx_pad = round_up(ctx, 32);
    const char* kp = c->packed + c->pack_off[w.b * c->KVH + w.h] * elem;
    const char* vp = kp + ctx_pad * D * elem;
    /* the first key row m's window keeps; pos grows with m, so a block's first row has its smallest */
    const int window = c->rules.window;
#define FIRST_KEY(m) (window > 0 && pos[m] + 1 > window ? pos[m] + 1 - window : 0)
    for (int m0 = 0; m0 < rows_pad; m0 += MR) {
        /* keys past this block's last position, or before its first row's window, are masked by
         * the softmax; skip their groups (the softmax never reads scores before a row's window) */
        const int gend = (pos[m0 + MR - 1] + 16) / 16;
        for (int g = FIRST_KEY(m0) / 16; g < gend; g += 2) {
#ifdef HAVE_BF16
            if (bf16) { scores_bf16((const uint16_t*)qt + (int64_t)m0 * D, D, (const uint16_t*)kp, g, gend,
                                    s + m0 * stride, stride, c->scale); continue; }
#endif
            scores_f32((const float*)qt + (int64_t)m0 * D, D, (const float*)kp, g, gend, s + m0 * stride, stride,
                       c->scale);
        }
    }
    causal_softmax(s, bf16 ? p16 : NULL, rows_pad, stride, pos, len, &c->rules, w.h * G, G);
    for (int m0 = 0; m0 < rows_pad; m0 += OR(D)) {
        const int n = pos[m0 + OR(D) - 1] + 1, j0 = FIRST_KEY(m0);  /* keys with a nonzero probability here */
#ifdef HAVE_BF16
        if (bf16) { output_bf16(p16 + m0 * stride, stride, (const uint16_t*)vp, j0 & ~1, (n + 1) & ~1, D,
                                o + (int64_t)m0 * D);
                    continue; }
#endif
        output_f32(s + m0 * stride, stride, (const float*)vp, j0, n, D, o + (int64_t)m0 * D);
    }
#undef FIRST_KEY
    for (int m = 0; m < rows; m++) {
        const int i = w.i0 + m / G;
        const int64_t dst = ((int64_t)(c->q_starts[w.b] + i) * c->H + w.h * G + m % G) * D;
        if (bf16) {
            uint16_t* ob = (uint16_t*)c->out + dst;
            for (int d = 0; d < D; d++) ob[d] = f32_to_bf16(o[(int64_t)m * D + d]);
        } else {
            memcpy((float*)c->out + dst, o + (int64_t)m * D, sizeof(float) * D);
        }
    }
    free(buf);
    return 0;
}

#define SPECIALISE(DIM) static int attend_item_d##DIM(const Call* c, Item w) { return attend_item(c, w, DIM); }
SPECIALISE(16)
SPECIALISE(32)
SPECIALISE(64)
SPECIALISE(96)
SPECIALISE(128)

/* Returns 1 when this build has a kernel for queries of dtype (DTYPE_F32, DTYPE_BF16) over pages of
 * kv_dtype (the same, or DTYPE_I8) and head_dim. */
int prefill_attention_supports(int dtype, int kv_dtype, int head_dim) {
    if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 96 && head_dim != 128) return 0;
    if (kv_dtype != dtype && kv_dtype != DTYPE_I8) return 0;
#ifdef HAVE_BF16
    if (dtype == DTYPE_BF16) return 1;
#endif
    return dtype == DTYPE_F32;
}

/* q, out: [T, H, D] packed rows (dtype DTYPE_F32 or DTYPE_BF16); k_cache, v_cache: [num_slots, KVH, D]
 * holding every context token (this step's included), of kv_dtype: dtype's, or DTYPE_I8 with k_scales,
 * v_scales bf16 [num_slots, KVH] (NULL otherwise); sequence b's new tokens are rows
 * [q_starts[b], q_starts[b] + num_new[b]) at positions context_lens[b] - num_new[b] + i. The layer's
 * rules: sliding_window > 0 (position p sees keys (p - sliding_window, p]), softcap > 0, sinks
 * [H] float32 or NULL. Returns 0, 1 when scratch memory could not be allocated, 2 for an unsupported dtype or D. */
int paged_prefill_attention(const void* q, void* out, int dtype, const void* k_cache, const void* v_cache,
                            int kv_dtype, const int32_t* block_tables, int max_blocks, const int32_t* q_starts,
                            const int32_t* num_new, const int32_t* context_lens, int num_seqs, int H, int KVH,
                            int D, int block_size, float scale, int num_threads, const uint16_t* k_scales,
                            const uint16_t* v_scales, int sliding_window, float softcap, const float* sinks) {
    if (!prefill_attention_supports(dtype, kv_dtype, D)) return 2;
    if (kv_dtype == DTYPE_I8 && (!k_scales || !v_scales)) return 2;
    const int G = H / KVH, elem = dtype == DTYPE_BF16 ? 2 : 4;
    /* packed K and V per (sequence, KV head) */
    int64_t* pack_off = (int64_t*)malloc(sizeof(int64_t) * (num_seqs * KVH + 1));
    if (!pack_off) return 1;
    pack_off[0] = 0;
    int num_items = 0;
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < KVH; h++)
            pack_off[b * KVH + h + 1] = pack_off[b * KVH + h] + round_up(context_lens[b], 32) * D * 2;
        const int TQ = tile_positions(G, context_lens[b]);
        num_items += num_new[b] > 0 ? KVH * ((num_new[b] + TQ - 1) / TQ) : 0;
    }
    char* packed = (char*)malloc((size_t)pack_off[num_seqs * KVH] * elem + 64);
    Item* items = (Item*)malloc(sizeof(Item) * (num_items > 0 ? num_items : 1));
    if (!packed || !items) { free(pack_off); free(packed); free(items); return 1; }
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int bh = 0; bh < num_seqs * KVH; bh++) {
        const int b = bh / KVH, h = bh % KVH, ctx = context_lens[b];
        const int64_t ctx_pad = round_up(ctx, 32);
        const int32_t* table = block_tables + (int64_t)b * max_blocks;
        char* kp = packed + pack_off[bh] * elem;
        char* vp = kp + ctx_pad * D * elem;
        if (kv_dtype == DTYPE_I8) {
#ifdef HAVE_BF16
            if (dtype == DTYPE_BF16) { pack_int8_bf16(k_cache, v_cache, k_scales, v_scales, table, block_size, ctx, ctx_pad, KVH,
                                             h, D, (uint16_t*)kp, (uint16_t*)vp); continue; }
#endif
            pack_int8_f32(k_cache, v_cache, k_scales, v_scales, table, block_size, ctx, ctx_pad, KVH, h, D,
                          (float*)kp, (float*)vp);
            continue;
        }
#ifdef HAVE_BF16
        if (dtype == DTYPE_BF16) { pack_bf16(k_cache, v_cache, table, block_size, ctx, ctx_pad, KVH, h, D, (uint16_t*)kp, (uint16_t*)vp); continue; }
#endif
        pack_f32(k_cache, v_cache, table, block_size, ctx, ctx_pad, KVH, h, D, (float*)kp, (float*)vp);
    }
    /* items, the longest causal prefixes (last tiles) first so the dynamic schedule ends balanced */
    num_items = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int TQ = tile_positions(G, context_lens[b]);
        for (int i0 = num_new[b] > 0 ? ((num_new[b] - 1) / TQ) * TQ : -1; i0 >= 0; i0 -= TQ)
            for (int h = 0; h < KVH; h++) {
                const int i1 = i0 + TQ < num_new[b] ? i0 + TQ : num_new[b];
                items[num_items++] = (Item){b, h, i0, i1};
            }
    }
    const Call call = {q, out, dtype, H, KVH, G, elem, q_starts, num_new, context_lens, packed, pack_off, scale,
                       {sliding_window, softcap, sinks}};
    int failed = 0;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int it = 0; it < num_items; it++) {
        const int f = D == 16 ? attend_item_d16(&call, items[it]) : D == 32 ? attend_item_d32(&call, items[it])
                      : D == 64 ? attend_item_d64(&call, items[it])
                      : D == 96 ? attend_item_d96(&call, items[it]) : attend_item_d128(&call, items[it]);
        if (f) failed = 1;
    }
    free(pack_off);
    free(packed);
    free(items);
    return failed;
}

#else /* no AVX-512: the engine keeps torch's SDPA for prefill */

int prefill_attention_supports(int dtype, int kv_dtype, int head_dim) {
    (void)dtype; (void)kv_dtype; (void)head_dim;
    return 0;
}

int paged_prefill_attention(const void* q, void* out, int dtype, const void* k_cache, const void* v_cache,
                            int kv_dtype, const int32_t* block_tables, int max_blocks, const int32_t* q_starts,
                            const int32_t* num_new, const int32_t* context_lens, int num_seqs, int H, int KVH,
                            int D, int block_size, float scale, int num_threads, const uint16_t* k_scales,
                            const uint16_t* v_scales, int sliding_window, float softcap, const float* sinks) {
    (void)sliding_window; (void)softcap; (void)sinks;
    (void)q; (void)out; (void)dtype; (void)k_cache; (void)v_cache; (void)kv_dtype; (void)block_tables;
    (void)max_blocks; (void)q_starts; (void)num_new; (void)context_lens; (void)num_seqs; (void)H; (void)KVH;
    (void)D; (void)block_size; (void)scale; (void)num_threads; (void)k_scales; (void)v_scales;
    return 2;
}
#endif
