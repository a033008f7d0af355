"""`batchgen compact` reads a part a row group at a time, on an object store too, never whole."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.manifest.manifest import SUCCESS_FILE, Manifest, load_manifest, write_success
from batchgen.io.store import writers
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import Lease
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands import compact as compact_module
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.durability.commit import Committer

pytestmark = pytest.mark.usefixtures("quick_lease_settle")

SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string()), ("text", pa.string())])
NUM_ROWS = 60


def test_compact_on_s3_holds_row_groups_not_parts(s3_out, monkeypatch):
    monkeypatch.setattr(writers, "ROW_GROUP_ROWS", 5)  # parts of 20 rows in row groups of 5
    store = open_store(s3_out)
    with Lease(store) as lease:
        manifest = Manifest(store, guard=lease)
        manifest.begin({"k": 1})
        committer = Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=20)
        for i in reversed(range(NUM_ROWS)):  # committed out of input order: compact reorders
            committer.add({"id": i, "error": None, "text": f"row {i}"}, "in.parquet", i)
        committer.commit()
        write_success(store, {"rows": NUM_ROWS})
    name = next(iter(load_manifest(store).parts))
    with store.open_input(name) as file:
        assert pq.ParquetFile(file).metadata.num_row_groups == 4

    held: list[int] = []
    real_group = compact_module._PartReader._group

    def group(self, part, index):
        table = real_group(self, part, index)
        held.append(sum(t.num_rows for t in self.groups.values()))
        return table

    def whole_part(*args, **kwargs):
        raise AssertionError("compact read a whole part")

    with monkeypatch.context() as patch:
        patch.setattr(compact_module._PartReader, "_group", group)
        patch.setattr(type(store), "read_table", whole_part)  # before: each part read whole
        summary = compact_output(store)
    assert summary.num_parts_after == 1 and store.exists(SUCCESS_FILE)
    assert held and max(held) <= compact_module.PART_CACHE * 5
    state = load_manifest(store)
    table = pa.concat_tables(store.read_table(n) for n in state.parts)
    assert table.column("id").to_pylist() == list(range(NUM_ROWS))
    assert table.column("text").to_pylist() == [f"row {i}" for i in range(NUM_ROWS)]
