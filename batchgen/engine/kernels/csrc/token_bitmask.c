/* Structured output's token mask on the CPU: the forbidden tokens of each constrained row set to -inf
 * in place, straight from the grammar's packed bitmask.
 *
 * Why C: unpacking the bitmask in torch makes a [rows, vocab] addend (a table gather by the mask's
 * bytes) and adds it to the logits, several full-size passes a step; here each 32-bit word is read
 * once, a word allowing all its 32 tokens costs one compare, and only forbidden tokens are written.
 * Bit i of word w allows token 32 * w + i (llguidance's layout); tokens past the words (logits wider
 * than the grammar's vocabulary) are forbidden too. Built at first use by
 * batchgen/engine/kernels/loader.py.
 */
#include <stdint.h>

#include "common.h"  /* the dtype codes */

/* logits: rows of cols values, row_stride elements apart; dtype DTYPE_F32, DTYPE_BF16 or DTYPE_F16;
 * bitmask: [num_rows_masked, num_words] int32, row m for logits row row_index[m]. */
void apply_token_bitmask(void* logits, int dtype, int64_t cols, int64_t row_stride, const int32_t* bitmask,
                         int64_t num_words, const int64_t* row_index, int64_t num_masked, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_masked * cols > 262144)
    for (int64_t m = 0; m < num_masked; m++) {
        const uint32_t* words = (const uint32_t*)bitmask + m * num_words;
        const int64_t base = row_index[m] * row_stride;
        float* f32 = (float*)logits + base;
        uint16_t* h16 = (uint16_t*)logits + base;
        const uint16_t neg_inf16 = dtype == DTYPE_BF16 ? 0xFF80u : 0xFC00u;  /* bfloat16, else float16 */
        for (int64_t t = 0; t < cols; t++) {
            const int64_t w = t >> 5;
            if (w < num_words) {
                const uint32_t word = words[w];
                if (word == 0xFFFFFFFFu) {  /* all 32 allowed: skip to the next word */
                    t |= 31;
                    continue;
                }
                if ((word >> (t & 31)) & 1u) continue;
            }
            if (dtype == DTYPE_F32) f32[t] = -__builtin_inff();
            else h16[t] = neg_inf16;
        }
    }
}
