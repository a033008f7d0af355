"""Input rows by reference on a real local Ray (2 CPUs): a read's output, cut into blocks of at most
the batch size by the driver's split (Ray Data may cut one block into several bundles, as slices),
comes out of iter_block_slices as references whose rows, fetched in another worker, are the input's
rows exactly once and in order; the driver itself never holds a row."""

from __future__ import annotations

import pyarrow as pa

from batchgen.jobs.executors.ray.block_refs import BlockSlices, fetch, iter_block_slices, references_available
from batchgen.jobs.executors.ray.driver import _split_blocks

ROWS, BATCH_ROWS = 100, 8


def test_references_to_split_blocks_fetch_every_row_once(ray_cluster):
    ray = ray_cluster

    def read_all(batch: dict):  # defined here so that Ray pickles it by value
        for _ in batch["file"]:
            for start in range(0, ROWS, 25):  # as executors/ray/stages.py read_file yields a file's read batches
                ids = list(range(start, start + 25))
                yield pa.table({"i": ids, "text": [f"row {i}" for i in ids]})

    rows = ray.data.from_items([{"file": 0}]).map_batches(read_all, batch_size=1, batch_format="pyarrow", num_cpus=0)
    rows = _split_blocks(rows, BATCH_ROWS)
    assert references_available(rows)
    slices = list(iter_block_slices(rows))
    assert all(isinstance(s, BlockSlices) and 0 < s.num_rows <= BATCH_ROWS for s in slices)
    assert sum(s.num_rows for s in slices) == ROWS

    @ray.remote(num_cpus=1)
    def fetched(s: BlockSlices) -> pa.Table:  # an engine's side of it
        return fetch(s)

    tables = ray.get([fetched.remote(s) for s in slices])
    assert [t.num_rows for t in tables] == [s.num_rows for s in slices]
    ids = [i for t in tables for i in t.column("i").to_pylist()]
    assert sorted(ids) == list(range(ROWS))
    assert all(t.column("text").to_pylist() == [f"row {i}" for i in t.column("i").to_pylist()] for t in tables)


def test_a_table_passes_through():
    table = pa.table({"i": [1, 2]})
    assert fetch(table) is table


def fake_dataset(bundles):
    class Dataset:
        def iter_internal_ref_bundles(self):
            return iter(bundles)

    return Dataset()


def test_bundle_shapes_of_other_ray_releases():
    """Ray 2.60's repartition hands out whole blocks, so the slices and the older (ref, metadata)
    pairs are read from stand-in bundles: a slice's rows, a whole block's, empty ones left out."""
    from types import SimpleNamespace as NS

    meta = NS(num_rows=10)
    sliced = NS(blocks=[NS(ref="a", metadata=meta), NS(ref="b", metadata=meta)],
                slices=[NS(start_offset=2, end_offset=5), None])
    empty = NS(blocks=[NS(ref="c", metadata=meta)], slices=[NS(start_offset=4, end_offset=4)])
    legacy = NS(blocks=[("d", meta), ("e", NS(num_rows=0))])  # no slices attribute
    out = list(iter_block_slices(fake_dataset([sliced, empty, legacy])))
    assert [(s.refs, s.ranges, s.num_rows) for s in out] == [(["a", "b"], [(2, 5), None], 13), (["d"], [None], 10)]


def test_a_slice_fetches_only_its_rows(ray_cluster):
    ray = ray_cluster
    block = ray.put(pa.table({"i": list(range(10))}))
    other = ray.put(pa.table({"i": [100, 101]}))
    rows = BlockSlices([block, other], [(2, 5), None], 5)
    assert ray.get(ray.remote(num_cpus=1)(fetch).remote(rows)).column("i").to_pylist() == [2, 3, 4, 100, 101]
