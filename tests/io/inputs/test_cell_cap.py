"""A cell of more than MAX_CELL_BYTES is listed as invalid by every reader, naming file, row and
column, so its row becomes an error row instead of a prompt built from it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.inputs import cells
from batchgen.io.inputs.cells import invalid_cells
from batchgen.io.inputs.discovery import resolve_inputs
from batchgen.io.inputs.readers import iter_batches

CAP = 100


@pytest.fixture(autouse=True)
def small_cap(monkeypatch):
    monkeypatch.setattr(cells, "MAX_CELL_BYTES", CAP)


def listed(path, fmt="auto", batch_size=2) -> dict[int, str]:
    """{file row: message} over every batch of the file."""
    (file,) = resolve_inputs([str(path)], fmt)
    out, first = {}, 0
    for batch in iter_batches(file, None, batch_size):
        out.update({first + row: message for row, message in invalid_cells(batch).items()})
        first += batch.num_rows
    return out


def test_parquet_cells_over_the_cap(tmp_path):
    path = tmp_path / "in.parquet"
    texts = ["short", "é" * 51, "x" * CAP, "ok", "y" * (CAP + 1)]  # 102 and 101 bytes are over
    pq.write_table(pa.table({"id": range(5), "text": texts, "blob": [b"", b"", b"", b"z" * 200, b""]}), path)
    assert listed(path) == {
        1: f"column 'text' holds 102 bytes, over the {CAP} bytes a cell may hold ({path}, row 1)",
        3: f"column 'blob' holds 200 bytes, over the {CAP} bytes a cell may hold ({path}, row 3)",
        4: f"column 'text' holds 101 bytes, over the {CAP} bytes a cell may hold ({path}, row 4)",
    }


def test_jsonl_cells_over_the_cap_join_the_invalid_ones(tmp_path):
    path = tmp_path / "in.jsonl"
    rows = [{"text": "a"}, {"text": "b" * 150}, {"text": "c\ud800" + "d" * 150}, {"text": "e"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = listed(path)
    assert sorted(found) == [1, 2]
    assert found[1] == f"column 'text' holds 150 bytes, over the {CAP} bytes a cell may hold ({path}, row 1)"
    assert "lone surrogate" in found[2] and f"over the {CAP} bytes a cell may hold ({path}, row 2)" in found[2]


def test_openai_batch_bodies_over_the_cap(tmp_path):
    path = tmp_path / "requests.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "q" * 200}]}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": body if i == 1 else {"model": "m", "messages": []}} for i in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = listed(path, "openai-batch")
    assert list(found) == [1] and found[1].startswith("column 'body' holds ") and f"({path}, row 1)" in found[1]
