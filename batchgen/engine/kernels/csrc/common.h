/* What every csrc/ file shares: ALWAYS_INLINE and the dtype codes the ctypes bindings pass
 * (batchgen/engine/kernels/common.py's DTYPE_CODES holds the same numbers; tests/engine/kernels/test_common.py
 * checks that they agree). */
#ifndef BATCHGEN_COMMON_H
#define BATCHGEN_COMMON_H

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_I8 2  /* KV pages only, with one bf16 scale per token and KV head */
#define DTYPE_F16 3

#endif
