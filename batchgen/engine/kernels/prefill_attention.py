"""ctypes binding of csrc/prefill_attention.c: the CPU prefill-attention kernel (loader.py builds
and loads it).

A step's prefill sequences go to the kernel together: it packs each one's context out of the
pages once and attends causally from there, so a chunk with a cached past needs no gather. The
kernel exists on AVX-512 CPUs for float32 and, with AVX512-BF16, bfloat16, head sizes 16, 32, 64, 96
and 128 (`supports`), over pages of the query's dtype or int8 pages with their scales
(--kv-cache-dtype int8: dequantized as they are packed, bit for bit as `kv_quant.dequantize`);
anything else keeps torch's SDPA path (engine/attention/sdpa.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES, KV_CODES, int8_scale_pointers, rule_args
from batchgen.engine.packed_seq import PackedSeq, block_table_tensor
from batchgen.engine.score_rules import NO_RULES, ScoreRules

SOURCE = loader.CSRC / "prefill_attention.c"
_P, _I = ctypes.c_void_p, ctypes.c_int
# paged_prefill_attention's parameters, in the C signature's order
KERNEL_ARGS = (
    ("q", _P), ("out", _P), ("dtype", _I), ("k_cache", _P), ("v_cache", _P), ("kv_dtype", _I),
    ("block_tables", _P), ("max_blocks", _I), ("q_starts", _P), ("num_new", _P), ("context_lens", _P),
    ("num_seqs", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I), ("block_size", _I),
    ("scale", ctypes.c_float), ("num_threads", _I), ("k_scales", _P), ("v_scales", _P),
    ("sliding_window", _I), ("softcap", ctypes.c_float), ("sinks", _P),
)


@dataclass(slots=True)
class PrefillBatch:
    """The step's prefill sequences (more than one new token) as the kernel reads them."""

    q_starts: torch.Tensor  # [P] int32: each one's first new token in the packed row
    num_new: torch.Tensor  # [P] int32
    context_lens: torch.Tensor  # [P] int32: cached past + new tokens
    block_tables: torch.Tensor  # [P, max_blocks] int32, padded with block 0 (never read)

    @staticmethod
    def build(seqs: list[PackedSeq], block_size: int) -> PrefillBatch | None:
        prefills = [s for s in seqs if s.num_new_tokens > 1]
        if not prefills:
            return None
        return PrefillBatch(
            q_starts=torch.tensor([s.start for s in prefills], dtype=torch.int32),
            num_new=torch.tensor([s.num_new_tokens for s in prefills], dtype=torch.int32),
            context_lens=torch.tensor([s.context_len for s in prefills], dtype=torch.int32),
            block_tables=block_table_tensor(prefills, block_size),
        )


class PagedPrefillKernel:
    """ctypes binding of `paged_prefill_attention`; see the C file for the contract."""

    def __init__(self, lib: ctypes.CDLL):
        self._supports = lib.prefill_attention_supports
        self._supports.argtypes = [_I, _I, _I]
        self._supports.restype = _I
        self._fn = lib.paged_prefill_attention
        self._fn.argtypes = [ctype for _, ctype in KERNEL_ARGS]
        self._fn.restype = _I

    @functools.cache  # noqa: B019 - one kernel object per process, a handful of keys
    def supports(self, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether queries of `dtype` over pages of `kv_dtype` (the same, or int8) have a kernel."""
        code, kv_code = FLOAT_CODES.get(dtype), KV_CODES.get(kv_dtype)
        return code is not None and kv_code is not None and bool(self._supports(code, kv_code, head_dim))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: PrefillBatch, block_size: int, scale: float,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, rules: ScoreRules = NO_RULES) -> None:
        """Writes the prefill rows of out [T, heads, head_dim] from q (same shape, contiguous) and the
        caches [num_slots, kv_heads, head_dim], which already hold this step's K/V (so int8 pages give
        the new tokens' K/V as the cache stores them). int8 caches need `kv_scales`: K's and V's bf16
        scales, each [num_slots, kv_heads]. `rules`: the layer's sliding window, softcap and sinks."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        assert q.is_contiguous() and out.is_contiguous() and q.dtype == out.dtype
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.int8)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2] == head_dim
        assert q.device.type == "cpu" and num_heads % num_kv_heads == 0
        k_scales, v_scales = int8_scale_pointers(k_cache, kv_scales)
        args = dict(
            q=q.data_ptr(), out=out.data_ptr(), dtype=FLOAT_CODES[q.dtype], k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), kv_dtype=KV_CODES[k_cache.dtype],
            block_tables=batch.block_tables.data_ptr(),
            max_blocks=batch.block_tables.shape[1], q_starts=batch.q_starts.data_ptr(),
            num_new=batch.num_new.data_ptr(), context_lens=batch.context_lens.data_ptr(),
            num_seqs=batch.q_starts.shape[0], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, scale=float(scale), num_threads=torch.get_num_threads(), k_scales=k_scales,
            v_scales=v_scales, **rule_args(rules, num_heads))
        failed = self._fn(*(args[name] for name, _ in KERNEL_ARGS))
        if failed == 1:
            raise MemoryError("paged prefill attention: out of memory for its scratch buffers")
        assert failed == 0, f"paged prefill attention refused its arguments ({failed})"


@functools.cache
def load() -> PagedPrefillKernel | None:
    """The kernel, built on first use; None where it cannot be built (loader.load_library logs why)."""
    lib = loader.load_library(SOURCE)
    return None if lib is None else PagedPrefillKernel(lib)
