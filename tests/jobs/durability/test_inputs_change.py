"""Exactly-once when inputs change between runs.

Derived ids ("<file>:<row>") must never be paired with other rows: a resume over other or changed
files is refused naming the file. With --id-column, rows and files may change: a changed prompt
is generated again and replaces its old row, and committed ids gone from the input are reported.
Schema drift between files is unified or refused before any commit. In-process, tiny random Llama.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.errors import ConfigError, InputError, InputsChanged, UnsupportedOutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, load_manifest
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status, status_lines
from tests.jobs.helpers import tiny_job_config

TEXTS = [f"doc {i} " + "xyz" * (i % 4) for i in range(9)]


def write(path, texts, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, **columns}), path)
    return path


def config(inputs, out, model_dir, **overrides):
    return tiny_job_config(inputs, out, model_dir, **{**dict(max_new_tokens=3, commit_every_rows=4, batch_size=4),
                                                      **overrides})


def table(out):
    return ds.dataset(str(out), format="parquet").to_table()


def test_a_nightly_job_with_a_same_named_file_in_another_directory_is_refused(tiny_model_dir, loaded, tmp_path):
    """day2/data.parquet into day1's output must not skip every row as committed."""
    day1 = write(tmp_path / "day1" / "data.parquet", TEXTS)
    day2 = write(tmp_path / "day2" / "data.parquet", [t.upper() for t in TEXTS])
    out = tmp_path / "out"
    run_job(config([day1], out, tiny_model_dir), loaded=loaded)
    with pytest.raises(InputsChanged) as e:
        run_job(config([day2], out, tiny_model_dir), loaded=loaded)
    message = str(e.value)
    assert f"{day1}: no longer an input" in message and f"{day2}: a new input" in message
    assert "--overwrite" in message and "--output" in message
    assert table(out).num_rows == len(TEXTS)  # nothing was skipped into a false _SUCCESS
    # the way out: a new output directory (or --overwrite) generates day2's rows
    fresh = run_job(config([day2], tmp_path / "out2", tiny_model_dir), loaded=loaded)
    assert fresh.num_rows == len(TEXTS) and fresh.num_rows_skipped == 0


def test_adding_a_file_is_refused_and_ids_keep_their_meaning(tiny_model_dir, loaded, tmp_path):
    """A second file with the same base name must not rename the first file's ids."""
    a = write(tmp_path / "a" / "data.parquet", TEXTS)
    b = write(tmp_path / "b" / "data.parquet", TEXTS[:3])
    out = tmp_path / "out"
    run_job(config([a], out, tiny_model_dir), loaded=loaded)
    ids = sorted(table(out).column("row_id").to_pylist())
    with pytest.raises(InputsChanged, match=f"{b}: a new input"):
        run_job(config([a, b], out, tiny_model_dir), loaded=loaded)
    assert sorted(table(out).column("row_id").to_pylist()) == ids
    summary = run_job(config([a, b], out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert summary.num_rows == len(TEXTS) + 3
    assert table(out).num_rows == len(TEXTS) + 3


def test_rows_inserted_before_a_resume_are_refused_naming_the_file(tiny_model_dir, loaded, tmp_path):
    """Case 3: an insert shifts "<file>:<row>" ids; committed outputs would belong to other prompts."""
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir, max_rows=5), loaded=loaded)
    write(src, ["an inserted row", *TEXTS])
    with pytest.raises(InputsChanged) as e:
        run_job(config([src], out, tiny_model_dir), loaded=loaded)
    assert f"{src}: 9 -> 10 rows" in str(e.value)
    # the same rows written again: the file's identity changed all the same (mtime), so refused too
    write(src, TEXTS)
    with pytest.raises(InputsChanged, match="modified since"):
        run_job(config([src], out, tiny_model_dir), loaded=loaded)


def test_overwrite_over_the_same_inputs_keeps_them_recorded(tiny_model_dir, loaded, tmp_path):
    """--overwrite drops the history before its "begin", the old "inputs" entry with it: the run
    must record its inputs again, or a later resume would compare against none."""
    src = write(tmp_path / "data.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir), loaded=loaded)
    run_job(config([src], out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert load_manifest(out).inputs["inputs"][0]["path"] == str(src)
    assert job_status(out)["rows"] == len(TEXTS)


def test_max_rows_may_change_over_unchanged_inputs(tiny_model_dir, loaded, tmp_path):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir, max_rows=5), loaded=loaded)
    rest = run_job(config([src], out, tiny_model_dir), loaded=loaded)
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 5, 5)


def test_a_changed_prompt_under_id_column_is_generated_again_and_replaces_its_row(tiny_model_dir, loaded,
                                                                                  tmp_path):
    """Case 3 with --id-column: new rows, new files and an edited prompt between runs."""
    src = write(tmp_path / "in.parquet", TEXTS, doc_id=list(range(len(TEXTS))))
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir, id_column="doc_id"), loaded=loaded)
    before = {r["doc_id"]: r for r in table(out).to_pylist()}
    assert all(len(r["prompt_hash"]) == 16 for r in before.values())
    edited = list(TEXTS)
    edited[4] = "a completely different document"
    write(src, edited + ["a new row"], doc_id=list(range(len(TEXTS) + 1)))
    extra = write(tmp_path / "more.parquet", ["from a new file"], doc_id=[100])
    summary = run_job(config([src, extra], out, tiny_model_dir, id_column="doc_id"), loaded=loaded)
    assert (summary.num_rows, summary.num_rows_changed, summary.num_rows_skipped) == (3, 1, len(TEXTS) - 1)
    assert summary.num_rows_replaced == 1
    after = {r["doc_id"]: r for r in table(out).to_pylist()}
    assert len(after) == table(out).num_rows == len(TEXTS) + 2  # each id exactly once
    assert after[4]["prompt_hash"] != before[4]["prompt_hash"]
    assert {i: r for i, r in after.items() if i not in (4, 9, 100)} == {i: r for i, r in before.items() if i != 4}
    load_manifest(out, keep_hashes=True).check_integrity()
    again = run_job(config([src, extra], out, tiny_model_dir, id_column="doc_id"), loaded=loaded)
    assert (again.num_rows, again.num_rows_changed) == (0, 0)


def test_status_reports_committed_ids_gone_from_the_input(tiny_model_dir, loaded, tmp_path):
    src = write(tmp_path / "in.parquet", TEXTS, doc_id=list(range(len(TEXTS))))
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir, id_column="doc_id"), loaded=loaded)
    write(src, TEXTS[:6], doc_id=list(range(6)))
    run_job(config([src], out, tiny_model_dir, id_column="doc_id"), loaded=loaded)
    status = job_status(out)
    assert status["orphans"] == {"num_rows": 3, "examples": [6, 7, 8]}
    assert any("3 committed rows whose id is no longer in the input" in line for line in status_lines(status))
    assert table(out).num_rows == len(TEXTS)  # reported, never deleted


def test_a_column_added_in_a_later_file_is_unified_before_any_commit(tiny_model_dir, loaded, tmp_path):
    """Case 4: the default passthrough took the union but read it from every file: 'no such column'
    after the first file's rows were committed."""
    a = write(tmp_path / "a.parquet", TEXTS, n=pa.array(range(len(TEXTS)), pa.int32()))
    b = write(tmp_path / "b.parquet", TEXTS[:3], n=pa.array([7, 8, 9], pa.int64()), lang=["en", "de", "fr"])
    out = tmp_path / "out"
    summary = run_job(config([a, b], out, tiny_model_dir, commit_every_rows=2), loaded=loaded)
    assert summary.num_rows == len(TEXTS) + 3 and (out / SUCCESS_FILE).exists()
    result = table(out)
    assert result.schema.field("n").type == pa.int64() and result.schema.field("lang").type == pa.string()
    rows = {r["row_id"]: r for r in result.to_pylist()}
    assert rows["a.parquet:1"]["lang"] is None and rows["b.parquet:1"]["lang"] == "de"


def test_a_type_conflict_is_refused_before_any_commit_naming_both_files(tiny_model_dir, loaded, tmp_path):
    a = write(tmp_path / "a.parquet", TEXTS, meta=list(range(len(TEXTS))))
    b = write(tmp_path / "b.parquet", TEXTS[:2], meta=["x", "y"])
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        run_job(config([a, b], out, tiny_model_dir), loaded=loaded)
    assert str(b) in str(e.value) and str(a) in str(e.value) and "'meta'" in str(e.value)
    assert not out.exists()
    # a column the job does not read may disagree
    summary = run_job(config([a, b], out, tiny_model_dir, keep_columns=["text"]), loaded=loaded)
    assert summary.num_rows == len(TEXTS) + 2


def test_a_late_jsonl_type_conflict_is_refused_before_any_commit(tiny_model_dir, loaded, tmp_path, monkeypatch):
    from batchgen.io.inputs import jsonl

    monkeypatch.setattr(jsonl, "JSONL_SCHEMA_SAMPLE_RECORDS", 4)
    src = tmp_path / "in.jsonl"
    lines = [f'{{"text": "row {i}", "n": {i}}}' for i in range(8)] + ['{"text": "late", "n": "not a number"}']
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="row 8"):
        run_job(config([src], out, tiny_model_dir, commit_every_rows=2), loaded=loaded)
    assert not out.exists()


@pytest.mark.parametrize("url", ["ftp://host/out", "hdfs://namenode/out", "file:///tmp/out", "s3://bucket-only"])
def test_url_output_is_refused_not_written_as_a_local_directory(tmp_path, url):
    """`--output s3://bucket/out` is no local directory named 's3:'. Object stores are written
    (tests/jobs/durability/test_s3_output.py); other URLs, and a bare bucket, are refused."""
    src = write(tmp_path / "in.parquet", TEXTS)
    os.chdir(tmp_path)
    with pytest.raises(UnsupportedOutputError, match="not supported|prefix inside the bucket"):
        build_config(None, inputs=[str(src)], output=url)
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())
    assert issubclass(UnsupportedOutputError, ConfigError) or UnsupportedOutputError.exit_code == 2


def test_object_store_output_urls_pass_validation(tmp_path):
    src = write(tmp_path / "in.parquet", TEXTS)
    assert build_config(None, inputs=[str(src)], output="s3://bucket/out").output == "s3://bucket/out"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "parquet-footer"])
def test_a_same_size_edit_that_keeps_the_mtime_is_refused(tiny_model_dir, loaded, tmp_path, monkeypatch, fmt):
    """`cp -p` / `rsync -a` of an edited file keeps size and modification time: the identity used
    to see nothing, and derived ids paired committed outputs with the edited rows."""
    if fmt == "parquet-footer":  # a file over the whole-file limit: its footer (here: a column's max) tells
        from batchgen.jobs.durability import identity

        monkeypatch.setattr(identity, "CONTENT_DIGEST_MAX_BYTES", 0)
    src = tmp_path / ("in.jsonl" if fmt == "jsonl" else "in.parquet")

    def write_rows(texts):
        if fmt == "jsonl":
            src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        else:
            write(src, texts)

    write_rows(TEXTS)
    out = tmp_path / "out"
    run_job(config([src], out, tiny_model_dir, max_rows=5), loaded=loaded)
    stat = src.stat()
    edited = [*TEXTS[:-1], TEXTS[-1].replace("doc", "dog")]  # the last row, the same length
    write_rows(edited)
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert src.stat().st_size == stat.st_size and src.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(InputsChanged, match=f"{src}: content changed"):
        run_job(config([src], out, tiny_model_dir), loaded=loaded)


def test_a_resume_says_which_files_it_compares_only_in_part(tiny_model_dir, loaded, tmp_path, monkeypatch, caplog):
    """Over the whole-file limit a Parquet file is known by its footer: an edit in place that keeps
    it is not seen, and the resume says so, naming the file; a file hashed whole is not named."""
    from batchgen.jobs.durability import identity

    small = write(tmp_path / "small.parquet", TEXTS[:2])
    large = write(tmp_path / "large.parquet", [" ".join(str(i * j + 7) for j in range(60)) for i in range(4)])
    assert small.stat().st_size < large.stat().st_size - 1
    monkeypatch.setattr(identity, "CONTENT_DIGEST_MAX_BYTES", large.stat().st_size - 1)
    out = tmp_path / "out"
    run_job(config([small, large], out, tiny_model_dir, max_rows=5), loaded=loaded)
    caplog.set_level("INFO", logger="batchgen")
    run_job(config([small, large], out, tiny_model_dir), loaded=loaded)
    said = [r.getMessage() for r in caplog.records if "not by every byte" in r.getMessage()]
    assert len(said) == 1 and str(large) in said[0] and str(small) not in said[0], said
    assert "--id-column" in said[0]
