/* The sampler's Gumbel noise on the CPU: engine/sampling/random_stream.py's hash, element by element.
 *
 * Why C: in torch the hash is a chain of about thirty integer ops and an indexed gather over the
 * [rows, window] block, each a pass with its own temporary and dispatch; at a decode step's sizes
 * their fixed costs, not the arithmetic, are what the sampler pays. Here each value is one loop
 * iteration. The integer steps are the same (exact, wrapping 32-bit arithmetic), the uniform is the
 * same float32 number, and -log(-log(u)) is computed in float32 as torch does, so the noise equals
 * torch's to the last bits of the logarithm. Built at first use by batchgen/engine/kernels/loader.py.
 */
#include <stdint.h>
#include <math.h>

#include "gumbel_hash.h"  /* gumbel_value */

/* key_lo, key_hi: [rows] (each row's key halves); token_ids: [rows, n] int64, ids_row_stride elements
 * apart (0: one [n] row of ids for every row); out: [rows, n] float32. perm(j) = lowbias32(j ^ salt). */
void gumbel_noise(const int32_t* key_lo, const int32_t* key_hi, const int64_t* token_ids, int64_t rows, int64_t n,
                  int64_t ids_row_stride, uint32_t salt, int uniform_bits, float* out, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t lo = (uint32_t)key_lo[r], hi = (uint32_t)key_hi[r];
        const int64_t* ids = token_ids + r * ids_row_stride;
        float* o = out + r * n;
        for (int64_t j = 0; j < n; j++) o[j] = gumbel_value(lo, hi, (uint32_t)ids[j], salt, uniform_bits);
    }
}
