"""A real local Ray instance for the Ray executor's tests: two CPUs, started once per module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """The tiny Llama loaded once per module, for the local executor's reference runs."""
    from batchgen.engine.model.loader import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")
