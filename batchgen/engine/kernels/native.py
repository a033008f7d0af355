"""The CPU decode-attention kernel (csrc/paged_decode.c): built once per machine, called via ctypes.

Building at first use rather than shipping a binary keeps the wheel pure Python and lets the
compiler target this CPU (-march=native: AVX-512, bf16 conversions). The shared object is cached
under the batchgen cache dir, keyed by the source, the flags, the compiler and the CPU's feature
flags, and published by an atomic rename so concurrent jobs never load a half-written file. A
cached file is loaded only from a directory nobody else can change, only if this user owns it,
nobody else may write it and its sha256 is the one its build recorded, and through the descriptor
those checks read (batchgen.engine.kernels.kernel_cache); else it is built again.
Without a C compiler, or if the build fails, `load()` returns None once (with a warning) and the
engine keeps the pure-torch attention path: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.attention.base import NO_RULES, ScoreRules
from batchgen.engine.kernels import kernel_cache
from batchgen.runtime.cache_dir import cache_root
from batchgen.runtime.stage import slow_stage

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
POINTWISE_SOURCE = Path(__file__).parent / "csrc" / "pointwise.c"  # fused RMSNorm, SiLU * up (engine/kernels/fused.py)
# compile flags: -fopenmp both for the parallel loop and for `omp simd` reductions (they vectorize
# float sums without -ffast-math, whose crtfastmath would change denormal handling process-wide)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
KV_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 2}  # int8 pages come with per-token, per-head bf16 scales
_BUILD_TIMEOUT_S = 120
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
        return q_dtype in DTYPE_CODES and kv_dtype in KV_DTYPE_CODES

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
            q=q.data_ptr(), out=out.data_ptr(), q_dtype=DTYPE_CODES[q.dtype], k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(), kv_dtype=KV_DTYPE_CODES[k_cache.dtype], block_tables=block_tables.data_ptr(),
            max_num_blocks=block_tables.shape[1], context_lens=context_lens.data_ptr(), num_seqs=num_seqs,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            scale=float(scale), num_threads=torch.get_num_threads(), k_scales=k_scales, v_scales=v_scales,
            **rule_args(rules, num_heads))
        failed = self._fn(*(args[name] for name, _ in KERNEL_ARGS))
        if failed:
            raise MemoryError("paged decode attention: out of memory for its scratch buffers")
        return out


def rule_args(rules: ScoreRules, num_heads: int) -> dict:
    """The C kernels' score-rule arguments: window 0 and softcap 0 mean none; sinks float32 [num_heads] or NULL."""
    sinks = rules.sinks
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (num_heads,)
    return dict(sliding_window=rules.sliding_window or 0, softcap=float(rules.softcap or 0.0),
                sinks=None if sinks is None else sinks.data_ptr())


def int8_scale_pointers(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                        ) -> tuple[int | None, int | None]:
    """The K and V scales' addresses for a C kernel reading int8 pages, each bf16 [num_slots, kv_heads]
    and contiguous (engine/kv/cache.py); (None, None) for pages of another dtype."""
    if k_cache.dtype != torch.int8:
        return None, None
    assert kv_scales is not None and all(t.dtype == torch.bfloat16 and t.is_contiguous()
                                         and t.shape == k_cache.shape[:2] for t in kv_scales)
    return kv_scales[0].data_ptr(), kv_scales[1].data_ptr()


@functools.cache
def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None where it cannot be built (logged once)."""
    if os.environ.get("BATCHGEN_NO_NATIVE"):
        return None
    try:
        return PagedDecodeKernel(_load(SOURCE))
    except (OSError, subprocess.SubprocessError, RuntimeError, kernel_cache.Untrusted) as e:
        log.warning("CPU attention kernel unavailable (%s); using the slower torch attention path", e)
        return None


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    return cc


@functools.cache
def load_library(source_path: Path) -> ctypes.CDLL | None:
    """Another csrc/ file built the same way (cached, atomic publish); None where it cannot be built."""
    if os.environ.get("BATCHGEN_NO_NATIVE"):
        return None
    try:
        return _load(source_path)
    except (OSError, subprocess.SubprocessError, RuntimeError, kernel_cache.Untrusted) as e:
        log.warning("CPU kernels of %s unavailable (%s); using the torch ops", source_path.name, e)
        return None


@functools.cache
def load_function(source_path: Path, name: str, argtypes: tuple) -> Any | None:
    """One C function of a csrc/ file with its argument types set (it returns nothing); None where the
    file cannot be built. Cached: each binding asks for its function at every call."""
    lib = load_library(source_path)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = None
    return fn


def _load(source_path: Path) -> ctypes.CDLL:
    """The built (or cached) kernel of `source_path`, loaded from the very file its checks read.

    The descriptor stays open for the life of the process: the dynamic loader knows a library by
    the path it was given, and a closed descriptor's number, reused, would name another file."""
    fd = kernel_cache.open_trusted(_build(source_path))
    try:
        return ctypes.CDLL(kernel_cache.fd_path(fd))
    except BaseException:
        os.close(fd)
        raise


def _build(source_path: Path = SOURCE) -> Path:
    cc = _compiler()
    source = source_path.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))  # #included
    key = hashlib.sha256(b"\0".join([source, headers, " ".join(CFLAGS).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    kernel_cache.make_dir(out_dir)
    unsafe = kernel_cache.dir_problem(out_dir)
    if unsafe is not None:
        raise RuntimeError(f"the kernel cache {out_dir} could be changed by others: {unsafe}; make it "
                           "writable by you alone (chmod go-w), or set BATCHGEN_CACHE_DIR to a directory that is")
    target = out_dir / f"{source_path.stem}-{key}.so"
    if target.exists() or target.is_symlink():
        why = kernel_cache.problem(target)
        if why is None:
            return target
        log.warning("not loading the cached kernel %s: %s; building it again", target, why)
        kernel_cache.remove(target)  # an OSError (another user's file in a sticky dir): no kernel
    with slow_stage(f"building the CPU kernels of {source_path.name} in {out_dir} (once per machine)", logger=log,
                    done_level=logging.DEBUG), tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj, lib = Path(tmp) / f"{source_path.stem}.o", Path(tmp) / f"{source_path.stem}.so"
        compile_cmd = [cc, *CFLAGS, "-c", str(source_path), "-o", str(obj)]
        # linked without -ffast-math-like flags: nothing may change the process's FP environment
        link_cmd = [cc, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"]
        for cmd in (compile_cmd, link_cmd):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {done.stderr.strip()[:500]}")
        kernel_cache.publish(lib, target)
    log.debug("built the CPU kernels of %s: %s", source_path.name, target)
    return target


def _cpu_flags() -> str:
    """This CPU's feature flags: a kernel built with -march=native must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
