"""A bound on oneDNN's kernel caches, set in the environment before the first CPU linear call.

The CPU linear layers run oneDNN (`engine/model/prepack.py`; plain `F.linear` in bf16 too), which
JIT-builds one kernel per call shape, the row count included, and keeps it in two LRU caches of
1024 entries each by default: oneDNN's primitive cache (the JIT code, ~0.5 MiB a kernel measured)
and ideep's per-thread cache of primitive descriptors in front of it. A job's steps call the
linears with every row count up to the step budget (2048 tokens on the CPU), so a long job's heap
grew until both caches were full, hundreds of MiB, for kernels of row counts it rarely met again
(benchmarks/results/2026-12-02-scale-rows.md).

Both read their capacity from the environment once, lazily: oneDNN when it creates its first
primitive, ideep on a thread's first call. So setting it before the job's first forward is enough;
the CLI sets it beside the OpenMP defaults, before torch is imported. A user's own value of a
cache's variable wins (oneDNN also reads the older DNNL_ and MKLDNN_ names);
BATCHGEN_KERNEL_CACHE_DEFAULTS=0 leaves both at their library defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# kernels kept per cache: a step calls each distinct linear shape (4-6 per model) at one or two
# row counts, so this keeps the last several steps' kernels; a miss rebuilds one cheaply next to
# a step's work, while 1024 of them hold hundreds of MiB of heap (benchmarks/kernels/kernel_cache.py;
# benchmarks/results/2026-12-02-scale-rows.md)
CAPACITY = 64
# what each cache reads: (the variable batchgen sets, every name the library reads for it)
_CACHES = {
    "onednn": ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
               ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY",
                "MKLDNN_PRIMITIVE_CACHE_CAPACITY")),
    "ideep": ("LRU_CACHE_CAPACITY", ("LRU_CACHE_CAPACITY",)),
}
SWITCH = "BATCHGEN_KERNEL_CACHE_DEFAULTS"


def apply_defaults(environ: MutableMapping[str, str] = os.environ, capacity: int = CAPACITY) -> dict[str, str]:
    """Cap each cache whose capacity the user has not set; return what was set."""
    if environ.get(SWITCH, "1") == "0":
        return {}
    set_now = {}
    for variable, user_names in _CACHES.values():
        if not any(name in environ for name in user_names):
            set_now[variable] = str(capacity)
    environ.update(set_now)
    return set_now
