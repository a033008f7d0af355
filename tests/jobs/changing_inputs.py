"""Inputs that change between kills, for the kill -9 soak: exactly-once under --id-column.

The job reads a directory (`--input DIR`), so a new file is picked up by the same command, as an
Airflow task's glob would. Changes, in order, one after each kill (the rest before the final run):

    0  rows appended to the file (new ids)
    1  a new file in the directory (new ids)
    2  the prompts of every 16th original row edited (same ids, new text)

The final inputs are the same for every seed, so one uninterrupted run over them is the reference
each seed's resumed output must equal: every id once, no row generated from an old prompt.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.jobs.kill_harness import Fixture, make_fixture

NUM_CHANGES = 3
NUM_APPENDED = 24
NUM_NEW_FILE = 24
EDIT_EVERY = 16
NEW_FILE_FIRST_ID = 100_000


def make_changing_fixture(directory: Path, num_rows: int) -> Fixture:
    """make_fixture's model and rows, the input file inside `directory/inputs/` (what --input names)."""
    base = make_fixture(directory, num_rows)
    inputs = directory / "inputs"
    inputs.mkdir()
    src = inputs / "in.parquet"
    shutil.move(base.src, src)
    return Fixture(base.model_dir, src, num_rows, inputs)


def copy_fixture(fixture: Fixture, directory: Path) -> Fixture:
    """The same model and the inputs copied into `directory`, to be changed there."""
    inputs = directory / "inputs"
    shutil.copytree(fixture.input, inputs)
    return Fixture(fixture.model_dir, inputs / fixture.src.name, fixture.num_rows, inputs)


def apply_change(fixture: Fixture, step: int) -> None:
    table = pq.read_table(fixture.src)
    if step == 0:
        n = table.num_rows
        extra = pa.table({"id": list(range(n, n + NUM_APPENDED)),
                          "text": [f"appended row {i}" for i in range(NUM_APPENDED)]})
        _replace(fixture.src, pa.concat_tables([table, extra.cast(table.schema)]))
    elif step == 1:
        ids = list(range(NEW_FILE_FIRST_ID, NEW_FILE_FIRST_ID + NUM_NEW_FILE))
        _replace(fixture.input / "more.parquet", pa.table({"id": ids, "text": [f"new file row {i}" for i in ids]}))
    elif step == 2:
        texts = table.column("text").to_pylist()
        for i in range(0, fixture.num_rows, EDIT_EVERY):
            texts[i] = f"edited {i}: {texts[i][::-1]}"
        _replace(fixture.src, table.set_column(1, "text", pa.array(texts, pa.string())))


def apply_all(fixture: Fixture, done: int) -> None:
    for step in range(done, NUM_CHANGES):
        apply_change(fixture, step)


def _replace(path: Path, table: pa.Table) -> None:
    """Write beside and rename: the job never reads a half-written file (as an upstream writer should)."""
    temp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temp, row_group_size=64)
    temp.replace(path)
