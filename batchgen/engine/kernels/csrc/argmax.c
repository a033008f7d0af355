/* Greedy sampling's argmax over the step's logits rows on the CPU.
 *
 * Why C: torch's max(dim=-1) on bf16 logits runs well below memory speed, and at a decode step's
 * 128 rows of a 49,152-token vocabulary it is a visible share of the step; two vector passes over
 * each row (its max, then the first index holding it) run at memory speed.
 *
 * Same result as torch.argmax / max(dim).indices: the first index of the maximum, and a NaN
 * counts as the maximum (the first NaN's index), so greedy output equals model.generate's.
 * Built at first use by batchgen/engine/kernels/loader.py like the other csrc/ files.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "common.h"  /* ALWAYS_INLINE, the dtype codes */

#include "bf16_convert.h"  /* load_one */

#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_load16.h"  /* tail, load16 */
#include "row_max.h"      /* row_max */

static int64_t argmax_row(const void* x, int bf16, int64_t n) {
    int any_nan;
    const float mx = row_max(x, bf16, n, &any_nan);
    if (any_nan) {
        for (int64_t i = 0; i < n; i++)
            if (isnan(load_one(x, bf16, i))) return i;
    }
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail(n - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, load16(x, bf16, i, k), m, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0;  /* n == 0, or every value -inf: index 0 is torch's answer too */
}
#else
static int64_t argmax_row(const void* x, int bf16, int64_t n) {
    int64_t best = 0;
    float m = n ? load_one(x, bf16, 0) : 0.f;
    if (isnan(m)) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (isnan(v)) return i;
        if (v > m) { m = v; best = i; }
    }
    return best;
}
#endif

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16.
 * out[r] = the first index of row r's maximum (of its first NaN, if any). */
void argmax_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out,
                 int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols);
}
