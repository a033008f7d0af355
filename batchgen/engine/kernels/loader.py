"""The one loader of the C kernels: each csrc/ file compiled into its own shared object, cached,
and loaded; every binding (paged_decode.py, argmax.py, ...) asks here for its library.

Building at first use rather than shipping a binary keeps the wheel pure Python and lets the
compiler target this CPU (-march=native: AVX-512, bf16 conversions). The shared object is cached
under the batchgen cache dir, keyed by the source, every csrc/ header, the flags, the compiler and
the CPU's feature flags (`cache_key`), and published by an atomic rename so concurrent jobs never
load a half-written file. A cached file is loaded only from a directory nobody else can change,
only if this user owns it, nobody else may write it and its sha256 is the one its build recorded,
and through the descriptor those checks read (kernel_cache.py); else it is built again.
Without a C compiler, or if the build fails, `load_library` returns None once (with a warning) and
the caller keeps its torch path: slower, never wrong.
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

from batchgen.engine.kernels import kernel_cache
from batchgen.runtime.cache_dir import cache_root
from batchgen.runtime.stage import slow_stage

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# compile flags: -fopenmp both for the parallel loop and for `omp simd` reductions (they vectorize
# float sums without -ffast-math, whose crtfastmath would change denormal handling process-wide)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC"]
_BUILD_TIMEOUT_S = 120
_LOAD_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError, kernel_cache.Untrusted)


@functools.cache
def load_library(source_path: Path, fallback: str = "the torch ops") -> ctypes.CDLL | None:
    """The library built from one csrc/ file; None where it cannot be built, with one warning
    naming what the caller does instead (`fallback`)."""
    if os.environ.get("BATCHGEN_NO_NATIVE"):
        return None
    try:
        return load(source_path)
    except _LOAD_ERRORS as e:
        log.warning("CPU kernels of %s unavailable (%s); using %s", source_path.name, e, fallback)
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


def load(source_path: Path) -> ctypes.CDLL:
    """The built (or cached) library of `source_path`, loaded from the very file its checks read.

    The descriptor stays open for the life of the process: the dynamic loader knows a library by
    the path it was given, and a closed descriptor's number, reused, would name another file."""
    fd = kernel_cache.open_trusted(build(source_path))
    try:
        return ctypes.CDLL(kernel_cache.fd_path(fd))
    except BaseException:
        os.close(fd)
        raise


def cache_key(source_path: Path, compiler_version: str) -> str:
    """What a cached build of `source_path` depends on. Every header beside it counts, included or
    not: a header edited without the key changing would leave a stale library loaded."""
    headers = b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    return hashlib.sha256(b"\0".join([source_path.read_bytes(), headers, " ".join(CFLAGS).encode(),
                                      compiler_version.encode(), _cpu_flags().encode(),
                                      platform.machine().encode()])).hexdigest()[:16]


def build(source_path: Path) -> Path:
    """The cached shared object of `source_path`, compiled and published first where it is missing
    or fails kernel_cache's checks."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = cache_key(source_path, version)
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


def compiler() -> str:
    """The C compiler the kernels are built with: $CC, else cc or gcc on the PATH."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    return cc


def _cpu_flags() -> str:
    """This CPU's feature flags: a kernel built with -march=native must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
