"""The job core's engine slot: one engine, hence one KV cache, at a time."""

from __future__ import annotations

import gc
import weakref

from batchgen.config.choices import Policy
from batchgen.config.job import build_config
from batchgen.jobs.pipeline.core import JobCore


def test_a_mode_switch_frees_the_previous_engine(tiny_model_dir, loaded):
    config = build_config(None, inputs=["x"], output="o", model=str(tiny_model_dir), device="cpu",
                          dtype="float32", kv_cache_memory="4MiB", batch_size=4)
    core = JobCore(config, loaded)
    first = core.engines.get(config.engine_policy())
    assert first.config.policy is Policy.CONTINUOUS  # auto starts continuous
    num_blocks = first.kv_cache.num_blocks
    gone = weakref.ref(first)
    del first
    static = core.engines.get(Policy.STATIC)
    gc.collect()
    assert gone() is None, "the continuous engine (and its KV cache) outlived the switch"
    assert static.kv_cache.num_blocks == num_blocks  # sized like the first, so every prompt still fits
    assert core.engines.get(Policy.STATIC) is static  # same mode: no rebuild
