"""The driver's block split on a real local Ray (2 CPUs): a read task's output, which Ray Data merges
into one block, reaches a 2-actor pool (one CPU each, so the split itself must ask for none) as
batches of at most the batch size, spread over both actors, and reaches the driver batch by batch."""

from __future__ import annotations

import os
import time

import pyarrow as pa

from batchgen.jobs.executors.ray.driver import _split_blocks

ROWS, BATCH_ROWS = 96, 8


def test_one_file_is_spread_over_both_actors_in_batches(ray_cluster):
    ray = ray_cluster
    # defined here so that Ray pickles them by value: its workers cannot import a test module
    def read_all(batch: dict) -> pa.Table:
        for _ in batch["file"]:
            for start in range(0, ROWS, BATCH_ROWS):  # slices, as executors/ray/stages.py read_file yields them
                yield pa.table({"i": list(range(start, start + BATCH_ROWS))})

    class WhichActor:
        def __call__(self, table: pa.Table) -> pa.Table:
            time.sleep(0.5)  # a batch takes a while, as generating does: a late second actor still gets work
            return table.append_column("pid", pa.array([os.getpid()] * table.num_rows, pa.int64()))

    rows = ray.data.from_items([{"file": 0}]).map_batches(read_all, batch_size=1, batch_format="pyarrow", num_cpus=0)
    pool = ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=2)
    out = _split_blocks(rows, BATCH_ROWS).map_batches(WhichActor, batch_size=BATCH_ROWS, batch_format="pyarrow",
                                                       compute=pool, num_cpus=1)
    batches = list(out.iter_batches(batch_size=None, batch_format="pyarrow"))
    assert sorted(i for b in batches for i in b.column("i").to_pylist()) == list(range(ROWS))
    assert max(b.num_rows for b in batches) <= BATCH_ROWS
    assert len({pid for b in batches for pid in b.column("pid").to_pylist()}) == 2
