"""The int8 KV cache: quantize on the cache write, dequantize on the torch paths' gathers.

Symmetric, per token and per KV head: `scale = max|x| / 127` over the head's `head_dim` values,
stored as bfloat16 beside the pages (`[num_slots, num_kv_heads]`, i.e. `[num_blocks, block_size,
num_kv_heads]`), and `q = round(x / scale)` in [-127, 127]. A token's K/V are never requantized, so
every later read sees exactly what the write stored. bf16 scales (not float32) keep the overhead at
2 bytes per 64-value head: 66 bytes per head and token against bf16's 128, 1.94x the tokens.

The attention function writes the cache only through `write` (one C call per layer on CPU) and
the torch paths read it through `gather`. The C kernels take the int8 pages and the scales
directly: the decode kernel applies the scales outside its inner loops (on AVX512-VNNI CPUs in
16-bit integer arithmetic, csrc/paged_decode_int8.h), the prefill kernel dequantizes each context
as it packs it, bit for bit as `dequantize`. Every path reads the dequantized values,
the prefill's own new tokens included (`fake_quantize` where SDPA attends over them directly), so
a model with an int8 cache is one model (tests compare it with `fake_quantize` inside plain attention).
"""

from __future__ import annotations

import torch

from batchgen.engine.kernels import kv_quant_write
from batchgen.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_DTYPE = torch.bfloat16
INT8_MAX = 127
MIN_SCALE = 1e-12  # an all-zero head quantizes to zeros instead of 0/0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the pages hold: the model's ("auto"), or int8."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        raise ConfigError(fp8_refusal(device))
    raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def fp8_refusal(device: torch.device) -> str:
    """Why --kv-cache-dtype fp8 is refused on `device`, and what it would take.

    fp8 (e4m3) pages need an attention kernel that reads them with per-(sequence, KV head) descale
    factors. Of flash-attn's packages only flash-attn 3 has one (`flash_attn_3`, built from the
    repository's hopper/ directory for sm90; not on PyPI): its `flash_attn_with_kvcache` and
    `flash_attn_varlen_func` take `k_descale`/`v_descale` (and q must be fp8 too). The `flash_attn`
    package our flash backend runs is flash-attn 2, whose functions have no descale arguments and
    no fp8 inputs. Wiring flash-attn 3 needs a Hopper GPU to test, which this build was not
    written on, so fp8 is refused everywhere rather than shipped untested."""
    where = ("on CUDA it needs flash-attn 3's fp8 kernels (the flash_attn_3 package, Hopper/sm90: "
             "k_descale/v_descale), which batchgen does not wire yet; flash-attn 2 has no fp8 path"
             if device.type == "cuda" else
             f"fp8 KV is CUDA-only (flash-attn 3 on Hopper) and this job runs on {device.type}")
    return f"kv_cache_dtype fp8 is not available: {where}; use --kv-cache-dtype int8 (every device)"


def scale_bytes_per_head(cache_dtype: torch.dtype) -> int:
    """Bytes of scale stored per token and KV head (0 for unquantized pages)."""
    return torch.empty((), dtype=SCALE_DTYPE).element_size() if cache_dtype == torch.int8 else 0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, kv_heads, head_dim] -> (int8 values [T, kv_heads, head_dim], bf16 scales [T, kv_heads])."""
    xf = x.float()
    # the scale is rounded to its stored dtype first, and the values divided by the rounded one
    scale = (xf.abs().amax(-1) / INT8_MAX).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    q = torch.round(xf / scale.float()[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim] with scales [...] -> `dtype` [..., head_dim]."""
    return q.to(dtype) * scale.to(dtype)[..., None]


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """What the cache gives back for `x`: quantize then dequantize, in x's dtype."""
    return dequantize(*quantize(x), x.dtype)


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
          slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new K/V ([T, kv_heads, head_dim]) quantized at `slot_mapping`.

    On CPU one C call per layer (csrc/kv_quant_write.c, the same bytes as `quantize`); the torch
    ops where that library cannot be built and on CUDA. Nothing is dequantized here: the decode
    kernels read the pages, and the one path that attends over the new K/V directly (the SDPA
    prefill of a sequence with no cached past) fake-quantizes its own slice."""
    kernel = kv_quant_write.load() if k.is_cpu else None
    if kernel is None or not kernel.write(k_cache, v_cache, k_scale, v_scale, slot_mapping, k, v):
        write_torch(k_cache, v_cache, k_scale, v_scale, slot_mapping, k, v)


def write_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`write` through torch ops (any device)."""
    kq, ks = quantize(k)
    vq, vs = quantize(v)
    k_cache.index_copy_(0, slot_mapping, kq)
    v_cache.index_copy_(0, slot_mapping, vq)
    k_scale.index_copy_(0, slot_mapping, ks)
    v_scale.index_copy_(0, slot_mapping, vs)


def gather(blocks: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """The pages `block_ids` in `dtype`: blocks [num_blocks, block_size, kv_heads, head_dim], scales
    [num_slots, kv_heads] or None for unquantized pages -> [len(block_ids), block_size, kv_heads, head_dim]."""
    pages = blocks.index_select(0, block_ids)
    if scales is None:
        return pages.to(dtype)
    page_scales = scales.view(blocks.shape[:3]).index_select(0, block_ids)
    return dequantize(pages, page_scales, dtype)
