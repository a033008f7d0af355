/* The end of an int8 layer's call (engine/quant/int8.py), per row r and output n, in f32, rounded
 * once to out's dtype:
 *     y[r][n] = (acc[r][n] - zero_points[r] * colsum[n]) * scales[r] + sum_i x[r][idx[i]] * wo[i][n]
 * acc: the int8 matmul's output, already times the weight's per-row scale: float32 (acc_dtype DTYPE_F32) or
 * the out dtype (then out may be acc itself). zero_points and colsum: NULL for symmetric
 * activations; with asymmetric ones acc must be float32, as the two terms are each up to ~255x the
 * result's step and cancel. k outlier channels idx of x [rows][x_cols] (out's dtype) times their
 * weight rows (engine/quant/outliers.py); k = 0: none. The outlier weight wo is one of
 *   OUTLIER_F32:  float32 [k][cols] (float32 models);
 *   OUTLIER_BF16: bf16 in dot-product layout (bf16 models, whose weights are bf16: nothing rounded):
 *                 per block of 16 output columns, ceil(k / 2) pairs of [16 lanes][2], lane c of pair
 *                 p holding wo[2p][j + c], wo[2p + 1][j + c], zeros padding an odd k and a partial
 *                 block (engine/quant/outliers.py, pack_bf16_pairs).
 * Why one pass: the per-token scale was a pass of its own, and the outlier channels as an
 * index_select plus a small matmul were a large share of the int8 layer's call.
 * Why the bf16 layout: as 16-lane f32 FMAs (four rows a load) the outlier products cost about the
 * whole gain of int8 over bf16 end to end; vdpbf16ps does 32 products an instruction (exact in f32,
 * as the FMAs' were) from half the bytes, eight rows a load, each 16 columns' weights loaded once
 * for all rows. (An int8 form, vpdpbusd on the outlier inputs quantized at a scale of their own,
 * was no faster and rounds them: not kept.) */
#ifndef BATCHGEN_FINISH_ROWS_H
#define BATCHGEN_FINISH_ROWS_H

#include <stdint.h>
#include <stdlib.h>

#include "common.h"        /* ALWAYS_INLINE, DTYPE_BF16 */
#include "bf16_convert.h"  /* bf16_to_f32, f32_to_bf16, load_one */

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_load16.h"   /* tail, load16 */
#include "simd_store16.h"  /* store16 */
#endif

#define FINISH_PARALLEL_MIN_ELEMS (1 << 16)  /* below this much work one thread is faster */
#define FINISH_ROWS 8
#define FINISH_TILE 512  /* columns */
enum { OUTLIER_F32 = 0, OUTLIER_BF16 = 1 };

#ifdef __AVX512F__
/* y += a.lo * w.even + a.hi * w.odd per lane: a = two bf16 (an input pair), w = 16 lanes of bf16 pairs */
ALWAYS_INLINE __m512 dot_pair(__m512 y, uint32_t a, __m512i w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(y, (__m512bh)_mm512_set1_epi32((int)a), (__m512bh)w);
#else
    const __m512 lo = _mm512_set1_ps(bf16_to_f32((uint16_t)(a & 0xFFFF))), hi = _mm512_set1_ps(bf16_to_f32((uint16_t)(a >> 16)));
    y = _mm512_fmadd_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), y);
    return _mm512_fmadd_ps(hi, _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000))), y);
#endif
}

#endif

void finish_rows(const void* acc, int acc_dtype, void* out, int dtype, const float* scales, const float* zero_points,
                 const float* colsum, const void* x, int64_t x_cols, const int64_t* idx, int64_t k, const void* wo,
                 int wo_form, int64_t rows, int64_t cols, int num_threads) {
    const int bf16 = dtype == DTYPE_BF16, acc_bf16 = acc_dtype == DTYPE_BF16;
    const int form = k > 0 ? wo_form : OUTLIER_F32;
    const int64_t kw = form == OUTLIER_BF16 ? (k + 1) / 2 : 0;  /* input pairs */
    const float* wf = (const float*)wo;
    /* the outlier inputs of every row, gathered once: bf16 pairs (xw) or floats (xk) */
    float* xk = form == OUTLIER_F32 && k > 0 ? (float*)malloc(sizeof(float) * rows * k) : NULL;
    uint32_t* xw = kw > 0 ? (uint32_t*)malloc(sizeof(uint32_t) * rows * kw) : NULL;
    if ((form == OUTLIER_F32 && k > 0 && !xk) || (kw > 0 && !xw)) abort();
    for (int64_t r = 0; r < rows; r++) {
        if (xk) {
            for (int64_t i = 0; i < k; i++) xk[r * k + i] = load_one(x, bf16, r * x_cols + idx[i]);
        } else if (xw) {
            const uint16_t* xr = (const uint16_t*)x + r * x_cols;
            for (int64_t p = 0; p < kw; p++)
                xw[r * kw + p] = (uint32_t)xr[idx[2 * p]] | (2 * p + 1 < k ? (uint32_t)xr[idx[2 * p + 1]] << 16 : 0u);
        }
    }
    /* Tiles of FINISH_TILE columns outer, then blocks of FINISH_ROWS rows, then 16 columns: a tile's
     * outlier weights (k = 29: 30 KB) stay in L1/L2 for every row and each row's acc is read in
     * 1 KB runs. Rows outer re-read all of wo per 8 rows (from L3 for the LM head's 49,152 columns);
     * 16 columns outer read acc 32 bytes a row at a time, slower on the LM head's wide rows. */
    const int64_t col_blocks = (cols + 15) / 16, tile_blocks = FINISH_TILE / 16;
    const int64_t tiles = (col_blocks + tile_blocks - 1) / tile_blocks;
    /* Threads split the rows into one contiguous chunk each, every chunk walking all tiles (tiles
     * outer within it, as above); only when there are fewer row blocks than threads (a few decode
     * rows: the LM head at one row) do they split tiles. Split by tiles alone, a 576-column layer
     * (two tiles, 512 and 64 columns) left one of two threads nearly all of the work. */
    const int64_t row_blocks = (rows + FINISH_ROWS - 1) / FINISH_ROWS;
    const int64_t chunks = row_blocks < num_threads ? row_blocks : num_threads;
    const int64_t chunk_rows = (row_blocks + chunks - 1) / chunks * FINISH_ROWS;
    #pragma omp parallel for collapse(2) num_threads(num_threads) if (rows * cols * (k + 1) >= FINISH_PARALLEL_MIN_ELEMS) schedule(static)
    for (int64_t chunk = 0; chunk < chunks; chunk++)
    for (int64_t tile = 0; tile < tiles; tile++)
    for (int64_t r0 = chunk * chunk_rows; r0 < rows && r0 < (chunk + 1) * chunk_rows; r0 += FINISH_ROWS) {
        const int64_t nr = rows - r0 < FINISH_ROWS ? rows - r0 : FINISH_ROWS;
        int64_t rr[FINISH_ROWS];  /* a short last block repeats its first row, stored once */
        for (int64_t t = 0; t < FINISH_ROWS; t++) rr[t] = t < nr ? r0 + t : r0;
        const int64_t jb_end = (tile + 1) * tile_blocks < col_blocks ? (tile + 1) * tile_blocks : col_blocks;
        for (int64_t jb = tile * tile_blocks; jb < jb_end; jb++) {
            const int64_t j = jb * 16;
#ifdef __AVX512F__
            const __mmask16 m = tail(cols - j);
            const __m512 cs = colsum ? _mm512_maskz_loadu_ps(m, colsum + j) : _mm512_setzero_ps();
            __m512 y[FINISH_ROWS];
            for (int64_t t = 0; t < FINISH_ROWS; t++) {
                const int64_t r = rr[t];
                const __m512 a = load16(acc, acc_bf16, r * cols + j, m);
                y[t] = _mm512_mul_ps(_mm512_fnmadd_ps(_mm512_set1_ps(zero_points ? zero_points[r] : 0.f), cs, a),
                                     _mm512_set1_ps(scales[r]));
            }
            if (xw) {
                const uint16_t* wj = (const uint16_t*)wo + jb * kw * 32;
                for (int64_t p = 0; p < kw; p++) {
                    const __m512i w = _mm512_loadu_si512(wj + p * 32);
                    for (int64_t t = 0; t < FINISH_ROWS; t++) y[t] = dot_pair(y[t], xw[rr[t] * kw + p], w);
                }
            } else {
                for (int64_t i = 0; i < k; i++) {
                    const __m512 w = _mm512_maskz_loadu_ps(m, wf + i * cols + j);
                    for (int64_t t = 0; t < FINISH_ROWS; t++) y[t] = _mm512_fmadd_ps(_mm512_set1_ps(xk[rr[t] * k + i]), w, y[t]);
                }
            }
            for (int64_t t = 0; t < nr; t++) store16(out, bf16, (r0 + t) * cols + j, m, y[t]);
#else
            for (int64_t t = 0; t < nr; t++) {
                const int64_t r = r0 + t;
                for (int64_t jj = j; jj < j + 16 && jj < cols; jj++) {
                    float y = (load_one(acc, acc_bf16, r * cols + jj) - (zero_points ? zero_points[r] * colsum[jj] : 0.f)) * scales[r];
                    if (xw) {
                        const uint16_t* wj = (const uint16_t*)wo + jb * kw * 32 + (jj - j) * 2;
                        for (int64_t p = 0; p < kw; p++) {
                            y += bf16_to_f32((uint16_t)(xw[r * kw + p] & 0xFFFF)) * bf16_to_f32(wj[p * 32]);
                            y += bf16_to_f32((uint16_t)(xw[r * kw + p] >> 16)) * bf16_to_f32(wj[p * 32 + 1]);
                        }
                    } else {
                        for (int64_t i = 0; i < k; i++) y += xk[r * k + i] * wf[i * cols + jj];
                    }
                    if (bf16) ((uint16_t*)out)[r * cols + jj] = f32_to_bf16(y);
                    else ((float*)out)[r * cols + jj] = y;
                }
            }
#endif
        }
    }
    free(xk);
    free(xw);
}

#endif
