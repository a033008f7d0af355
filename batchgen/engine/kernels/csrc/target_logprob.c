/* score's log-probability of each row's target token: x[r, t_r] - logsumexp(x[r, :]) over the LM
 * head's logits, float32 or bfloat16.
 *
 * Why C: torch gets there through a float32 copy of the bf16 logits and a log_softmax that writes
 * a whole [rows, vocab] result of which one value per row is read, three passes over 192 KiB a
 * row of SmolLM2's vocabulary; here two passes read each row where it lies (its max, then the sum
 * of exp(x - max)) and write one double.
 *
 * Accuracy: exp16 is within 2 ulp of expf; the sum runs in float lanes over blocks of 1,024 values,
 * each block's lanes added into doubles, so the result stays within ~1e-6 of torch's log_softmax
 * (tests/engine/kernels/test_target_logprob.py). As torch's: a NaN or +inf anywhere in a row, or a
 * row that is -inf everywhere, gives NaN (inf - inf); a -inf target gives -inf.
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
#include "simd_exp.h"     /* exp16 */
#include "row_max.h"      /* row_max */

#define BLOCK 1024

static double target_logprob_row(const void* x, int bf16, int64_t n, int64_t target) {
    int any_nan;
    const float m = row_max(x, bf16, n, &any_nan);
    if (any_nan || isinf(m)) return NAN;
    const __m512 vmax = _mm512_set1_ps(m);
    double total = 0.0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = start; i < end; i += 16) {
            const __mmask16 k = tail(end - i);
            const __m512 e = exp16(_mm512_sub_ps(load16(x, bf16, i, k), vmax));
            acc = _mm512_mask_add_ps(acc, k, acc, e);
        }
        total += _mm512_reduce_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(acc)))
               + _mm512_reduce_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(acc, 1)));
    }
    return (double)load_one(x, bf16, target) - (double)m - log(total);
}
#else
static double target_logprob_row(const void* x, int bf16, int64_t n, int64_t target) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float v = load_one(x, bf16, i);
        if (isnan(v)) return NAN;
        if (v > m) m = v;
    }
    if (isinf(m)) return NAN;
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += exp((double)load_one(x, bf16, i) - m);
    return (double)load_one(x, bf16, target) - (double)m - log(total);
}
#endif

/* x: [rows] rows of cols logits, row_stride elements apart; dtype DTYPE_F32 or DTYPE_BF16;
 * targets[r] in [0, cols). out[r] = log_softmax(x[r])[targets[r]], in double. */
void target_logprob_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride,
                         const int64_t* targets, double* out, int num_threads) {
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = target_logprob_row((const char*)x + r * row_stride * elem, dtype == DTYPE_BF16, cols, targets[r]);
}
