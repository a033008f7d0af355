"""A sharded job's share of a Parquet file: rows [start, stop), reading only the row groups that hold them."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.inputs.discovery import resolve_inputs
from batchgen.io.inputs.readers import iter_batches


@pytest.fixture
def grouped(tmp_path):
    """95 rows in row groups of 10 (the last one 5)."""
    path = tmp_path / "grouped.parquet"
    pq.write_table(pa.table({"n": list(range(95))}), path, row_group_size=10)
    assert pq.ParquetFile(path).metadata.num_row_groups == 10
    return resolve_inputs([str(path)])[0]


@pytest.mark.parametrize("rows", [(0, 95), (7, 33), (30, 40), (94, 95), (50, 50), (0, 1), (9, 11)])
@pytest.mark.parametrize("batch_size", [4, 10, 256])
def test_a_row_range_reads_exactly_those_rows(grouped, rows, batch_size):
    import dataclasses

    share = dataclasses.replace(grouped, rows=rows)
    got = [n for batch in iter_batches(share, ["n"], batch_size) for n in batch.column(0).to_pylist()]
    assert got == list(range(*rows))
    assert share.num_rows_read == rows[1] - rows[0] and share.first_row == rows[0]
