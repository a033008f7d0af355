"""The kernel-cache bound the CLI sets before the first forward (batchgen/runtime/onednn_cache.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.runtime import onednn_cache

CAP = str(onednn_cache.CAPACITY)


def test_caps_both_caches_unless_the_user_chose():
    env: dict[str, str] = {}
    assert onednn_cache.apply_defaults(env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": CAP, "LRU_CACHE_CAPACITY": CAP}
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": CAP, "LRU_CACHE_CAPACITY": CAP}


def test_a_users_value_wins_per_cache():
    # oneDNN reads ONEDNN_ before DNNL_: setting ours over a user's DNNL_ value would override it
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "MKLDNN_PRIMITIVE_CACHE_CAPACITY"):
        env = {name: "1024"}
        assert onednn_cache.apply_defaults(env) == {"LRU_CACHE_CAPACITY": CAP}
        assert env == {name: "1024", "LRU_CACHE_CAPACITY": CAP}
    env = {"LRU_CACHE_CAPACITY": "8"}
    assert onednn_cache.apply_defaults(env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": CAP}
    assert env["LRU_CACHE_CAPACITY"] == "8"


def test_switch_off_leaves_the_library_defaults():
    env = {onednn_cache.SWITCH: "0"}
    assert onednn_cache.apply_defaults(env) == {}
    assert env == {onednn_cache.SWITCH: "0"}


HEAP_GROWTH = """
import ctypes, json, torch
from batchgen.engine.model.prepack import pack_linear_layers
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
try:
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
except (OSError, AttributeError):  # not glibc 2.33+
    print("null")
    raise SystemExit
mallinfo2.restype = MallInfo2
used = lambda: mallinfo2().uordblks + mallinfo2().hblkhd
layer = torch.nn.Linear(64, 64, bias=False)
assert pack_linear_layers(torch.nn.Sequential(layer), available_bytes=1 << 40) == 1
x = torch.randn(400, 64)
with torch.no_grad():
    layer(x[:1])
    before = used()
    for rows in range(1, 401):  # one kernel per row count
        layer(x[:rows])
print(json.dumps((used() - before) / 2**20))
"""


def _heap_growth_mib(caps: dict[str, str]) -> float | None:
    import json
    import os

    env = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    env.update(caps, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", HEAP_GROWTH], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_variables_bound_this_torchs_kernel_caches():
    """The names are the ones torch's bundled oneDNN and ideep read: 400 row counts of one layer
    keep 400 kernels in each cache by default, at most 4 with both capped at 4."""
    env: dict[str, str] = {}
    onednn_cache.apply_defaults(env, capacity=4)
    capped = _heap_growth_mib(env)
    if capped is None:
        pytest.skip("glibc's mallinfo2 is needed to read the heap")
    default = _heap_growth_mib({})
    assert default > 20  # ~0.1 MiB a kernel at this shape (f32, 64x64)
    assert capped < default / 5, (capped, default)


def test_the_command_sets_it_before_torch_loads():
    code = ("import os, sys\nfrom batchgen import cli\nsys.argv = ['batchgen', '--version']\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'),"
            " 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items()
           if "CACHE_CAPACITY" not in k and k != onednn_cache.SWITCH}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split()[-3:] == [CAP, CAP, "False"]
