"""The kernel-cache bound the CLI sets before the first forward (batchgen/onednn_cache.py)."""

from __future__ import annotations

import subprocess
import sys

from batchgen import onednn_cache

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


def test_the_command_sets_it_before_torch_loads():
    code = ("import os, sys\nfrom batchgen import cli\nsys.argv = ['batchgen', '--version']\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), os.environ.get('LRU_CACHE_CAPACITY'),"
            " 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items()
           if "CACHE_CAPACITY" not in k and k != onednn_cache.SWITCH}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split()[-3:] == [CAP, CAP, "False"]
