"""The driver's engine pool on a real local Ray (2 CPUs), with stand-in engines that take no model:
one input's batches spread over both engines, and an engine that dies mid-job has its batches sent
again, so every row comes back exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa

from batchgen.jobs.executors.ray.dispatch import EnginePool
from tests.jobs.helpers import tiny_job_config

ROWS, BATCH_ROWS = 96, 8


def stand_in(die_flag: str | None = None) -> type:
    """An engine's interface (ready, generate) without a model; defined in a function so that Ray
    pickles it by value (its workers cannot import a test module)."""

    class StandIn:
        def __init__(self, config, keep_warm_s):
            pass

        def ready(self) -> int:
            return os.getpid()

        def generate(self, job, table: pa.Table) -> pa.Table:
            if die_flag and not os.path.exists(die_flag) and table.column("i")[0].as_py() == 0:
                Path(die_flag).touch()
                os._exit(1)  # the process dies with this batch in hand, as an OOM kill would
            time.sleep(0.3)  # a batch takes a while, as generating does: a late second engine still gets work
            return table.append_column("pid", pa.array([os.getpid()] * table.num_rows, pa.int64()))

    return StandIn


def batches():
    return iter(pa.table({"i": list(range(start, start + BATCH_ROWS))}) for start in range(0, ROWS, BATCH_ROWS))


def make_pool(ray, tmp_path, die_flag=None):
    config = tiny_job_config([tmp_path / "in.parquet"], tmp_path / "out", tmp_path / "model")
    return EnginePool(ray, config, {"num_cpus": 1}, 2, actor_class=stand_in(die_flag))


def test_batches_are_spread_over_both_engines(ray_cluster, tmp_path):
    pool = make_pool(ray_cluster, tmp_path)
    try:
        out = list(pool.generate(ray_cluster.put(None), batches(), lambda: None))
    finally:
        pool.close()
    assert sorted(i for b in out for i in b.column("i").to_pylist()) == list(range(ROWS))
    assert max(b.num_rows for b in out) <= BATCH_ROWS
    assert len({pid for b in out for pid in b.column("pid").to_pylist()}) == 2


def test_a_dead_engines_batches_are_sent_again(ray_cluster, tmp_path):
    flag = tmp_path / "died"
    pool = make_pool(ray_cluster, tmp_path, die_flag=str(flag))
    try:
        out = list(pool.generate(ray_cluster.put(None), batches(), lambda: None))
    finally:
        pool.close()
    assert flag.exists() and pool.deaths == 1
    assert sorted(i for b in out for i in b.column("i").to_pylist()) == list(range(ROWS))  # each row once
