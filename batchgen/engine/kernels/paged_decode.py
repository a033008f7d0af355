"""ctypes binding of csrc/paged_decode.c: decode attention straight from the paged KV cache, one
query token per sequence (loader.py builds and loads it).

Without a C compiler, or if the build fails, `load()` returns None once (with a warning) and the
engine keeps the pure-torch attention path: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from batchgen.engine.kernels import loader
from batchgen.engine.kernels.common import FLOAT_CODES, KV_CODES, int8_scale_pointers, rule_args
from batchgen.engine.score_rules import NO_RULES, ScoreRules

SOURCE = loader.CSRC / "paged_decode.c"
# paged_decode_attention's parameters, in the C signature's order: the one place that order lives
_P, _I = ctypes.c_void_p, ctypes.c_int
KERNEL_ARGS = (
    ("q", _P), ("out", _P), ("q_dtype", _I), ("k_cache", _P), ("v_cache", _P), ("kv_dtype", _I),
    ("block_tables", _P), ("max_num_blocks", _I), ("context_lens", _P), ("num_seqs", _I), ("num_heads", _I),
    ("num_kv_heads", _I), ("head_dim", _I), ("block_size", _I), ("scale", ctypes.c_float), ("num_threads", _I),
    ("k_scales", _P), ("v_scales", _P), ("sliding_window", _I), ("softcap", ctypes.c_float), ("sinks", _P),
)


class PagedDecodeKernel:
    """ctypes binding of `paged_decode_attention`; see the C file for the contract."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_decode_attention
        fn.argtypes = [ctype for _, ctype in KERNEL_ARGS]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return q_dtype in FLOAT_CODES and kv_dtype in KV_CODES

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 rules: ScoreRules = NO_RULES) -> torch.Tensor:
        """q [B, num_heads, head_dim] -> out [B, num_heads, head_dim]; caches [num_slots, kv_heads, head_dim].

        int8 caches need `kv_scales`: K's and V's bf16 scales, each [num_slots, kv_heads]. `rules`: the
        layer's sliding window, softcap and sinks."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.dtype == torch.int32 and block_tables.is_contiguous()
        assert context_lens.dtype == torch.int32 and context_lens.shape == (num_seqs,)
        assert k_cache.shape[2] == head_dim and num_heads % num_kv_heads == 0
        assert q.device.type == "cpu" and k_cache.device.type == "cpu"
        k_scales, v_scales = int8_scale_pointers(k_cache, kv_scales)
        out = torch.empty_like(q)
        args = dict(
            q=q.data_ptr(), out=out.data_ptr(), q_dtype=FLOAT_CODES[q.dtype], k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), kv_dtype=KV_CODES[k_cache.dtype], block_tables=block_tables.data_ptr(),
            max_num_blocks=block_tables.shape[1], context_lens=context_lens.data_ptr(), num_seqs=num_seqs,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            scale=float(scale), num_threads=torch.get_num_threads(), k_scales=k_scales, v_scales=v_scales,
            **rule_args(rules, num_heads))
        failed = self._fn(*(args[name] for name, _ in KERNEL_ARGS))
        if failed:
            raise MemoryError("paged decode attention: out of memory for its scratch buffers")
        return out


@functools.cache
def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None where it cannot be built (logged once)."""
    lib = loader.load_library(SOURCE, "the slower torch attention path")
    return None if lib is None else PagedDecodeKernel(lib)
