"""Partial checkpoints in the manifest: the latest entry is the set, snapshots carry it, "begin" drops it."""

from __future__ import annotations

import pyarrow as pa

from batchgen.io.manifest import manifest as manifest_module
from batchgen.io.manifest.manifest import MANIFEST_DIR, Manifest, PartRecord, load_manifest
from batchgen.io.manifest.partials import PartialRow, clean_partial_files, read_partials, write_partials
from batchgen.io.store.schema import output_schema
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.status import job_status, status_lines

SCHEMA = output_schema(pa.field("id", pa.int64()), [])


def commit(manifest, writer, ids):
    rows = [{"id": i, "generated_text": f"t{i}", "finish_reason": "stop", "num_prompt_tokens": 1,
             "num_generated_tokens": 1, "error": None, "prompt_hash": f"{i:016x}"} for i in ids]
    part = writer.stage_part(rows, tag=f".{manifest.state.last_seq + 1:08d}")
    record = PartRecord.staged(part, list(ids), [False] * len(ids), ["/in.parquet"] * len(ids), list(ids),
                               [f"{i:016x}" for i in ids])
    manifest.commit([(part, record)])


def partial_files(out):
    return sorted(p.name for p in (out / MANIFEST_DIR).glob("*.partials.json"))


def test_partials_round_trip_through_snapshots_and_begin(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "SNAPSHOT_EVERY_ENTRIES", 3)
    out = tmp_path / "out"
    out.mkdir()
    manifest = Manifest(out)
    manifest.begin({"model": "m"})
    rows = [PartialRow(7, "ab" * 8, (5, 6, 7), b"\x00\x01state"), PartialRow("x:1", None, (9,), None)]
    write_partials(manifest, rows, "fp")
    assert read_partials(out, load_manifest(out).partials, "fp") == {(7, 0): rows[0], ("x:1", 0): rows[1]}
    assert read_partials(out, load_manifest(out).partials, "other") == {}  # another config's: unused
    write_partials(manifest, rows[:1], "fp")  # the newer set replaces the older, whose file goes
    assert len(partial_files(out)) == 1
    writer = PartWriter(out, SCHEMA)
    for i in range(4):  # enough commits for a snapshot, which drops the "partials" entry itself
        commit(manifest, writer, [i])
    state = load_manifest(out)
    assert state.snapshot_seq is not None and state.num_committed_rows == 4
    assert read_partials(out, state.partials, "fp") == {(7, 0): rows[0]}
    assert job_status(out)["partial_rows"] == 1 and job_status(out)["partial_tokens"] == 3
    assert "in flight when stopped: 1 rows with 3 tokens generated" in "\n".join(status_lines(job_status(out)))
    (out / MANIFEST_DIR / ".stale.partials.json").write_text("{}")
    (out / MANIFEST_DIR / "00000099.partials.json").write_text("{}")  # written, never committed
    clean_partial_files(out, keep=state.partials["file"])
    assert partial_files(out) == [state.partials["file"]]
    manifest = Manifest(out, state)
    manifest.begin({"model": "other"})
    assert load_manifest(out).partials is None
