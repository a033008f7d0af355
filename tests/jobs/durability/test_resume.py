"""Resuming run_job: committed rows are skipped, error rows retried and replaced, a different
config refused, --overwrite starts over, and a crash at any commit stage resumes to the same
output as an uninterrupted run. In-process, on the tiny random Llama (subprocess kills are in
test_kill.py)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.errors import ErrorRateExceeded, FingerprintMismatch, InputError, OutputError
from batchgen.io.manifest.manifest import MANIFEST_DIR, SUCCESS_FILE, load_manifest
from batchgen.io.store import local_files
from batchgen.jobs.commands.run import SUMMARY_FILE, run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.tiny import make_tiny_model

MAX_NEW = 4
TEXTS = [f"row {i} " + "abcdefghij"[: i % 10 + 1] for i in range(23)]


class Crash(BaseException):
    """The process dying at a fault-hook stage (no except-Exception or OSError path catches it)."""


def write_input(path, texts=TEXTS, ids=None):
    pq.write_table(pa.table({"id": ids if ids is not None else list(range(len(texts))), "text": texts}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=MAX_NEW,
                                                          commit_every_rows=5, batch_size=4), **overrides})


def output(out) -> dict:
    return committed_rows(out)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, loaded, tmp_path_factory):
    """An uninterrupted run over TEXTS: what every resumed run must end up equal to."""
    tmp = tmp_path_factory.mktemp("reference")
    src = write_input(tmp / "in.parquet")
    run_job(config(src, tmp / "out", tiny_model_dir), loaded=loaded)
    return output(tmp / "out")


def test_rerun_after_success_processes_nothing(tiny_model_dir, loaded, tmp_path, reference):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    first = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert first.num_rows == len(TEXTS) and first.num_commits == 5 and first.complete
    assert json.loads((out / SUCCESS_FILE).read_text())["rows"] == len(TEXTS)
    names = sorted(p.name for p in out.iterdir())
    again = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert (again.num_rows, again.num_rows_skipped, again.num_commits) == (0, len(TEXTS), 0)
    assert sorted(p.name for p in out.iterdir()) == names
    assert output(out) == reference
    assert json.loads((out / SUMMARY_FILE).read_text())["num_rows_skipped"] == len(TEXTS)


def test_max_rows_then_the_rest(tiny_model_dir, loaded, tmp_path, reference):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    part = run_job(config(src, out, tiny_model_dir, max_rows=7), loaded=loaded)
    assert part.num_rows == 7 and sorted(output(out)) == list(range(7))
    assert (out / SUCCESS_FILE).exists()  # every row this run was asked for is committed
    rest = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 7, 7)
    assert output(out) == reference


@pytest.mark.parametrize("stage", ["write", "fsync", "file_write", "file_rename", "file_fsync_dir", "rename",
                                   "fsync_staged"])
@pytest.mark.parametrize("nth", [1, 3])
def test_a_crash_at_any_commit_stage_resumes_to_the_same_output(tiny_model_dir, loaded, tmp_path, monkeypatch,
                                                                 reference, stage, nth):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    calls = []

    def die(current):
        if current == stage:
            calls.append(current)
            if len(calls) == nth:
                raise Crash

    monkeypatch.setattr(local_files, "_fault_hook", die)
    with pytest.raises(Crash):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert not (out / SUCCESS_FILE).exists()
    visible = ds.dataset(str(out), format="parquet").to_table().column("id").to_pylist() \
        if list(out.glob("part-*")) else []
    assert len(visible) == len(set(visible))
    committed = load_manifest(out).num_committed_rows
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows == len(TEXTS) - committed and summary.num_rows_skipped == committed
    assert output(out) == reference
    assert not list(out.glob(".*"))
    state = load_manifest(out)
    state.check_integrity()
    assert sorted(p.name for p in out.glob("part-*")) == sorted(state.parts)


def test_a_different_config_is_refused_before_the_model_loads(tiny_model_dir, loaded, tmp_path):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=3), loaded=loaded)
    before = {p.name for p in out.iterdir()}
    # no `loaded`, and a model path that does not exist: the refusal must come first
    with pytest.raises(FingerprintMismatch) as info:
        run_job(config(src, out, tmp_path / "no-such-model", max_new_tokens=MAX_NEW + 1, temperature=0.5))
    message = str(info.value)
    assert info.value.exit_code == 2
    assert f"max_new_tokens {MAX_NEW} -> {MAX_NEW + 1}" in message and "temperature 0.0 -> 0.5" in message
    assert "3 rows committed" in message and "--overwrite" in message
    assert {p.name for p in out.iterdir()} == before


def test_another_model_is_refused_by_its_content_hash(tiny_model_dir, loaded, tmp_path, tokenizer):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=3), loaded=loaded)
    other = tmp_path / "other-model"
    make_tiny_model("llama", seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(FingerprintMismatch, match=f"model_revision '{loaded.revision}' -> "):
        run_job(config(src, out, other))
    # the same model under another path is the same model: it resumes
    copy = tmp_path / "same-model-elsewhere"
    copy.mkdir()
    for item in tiny_model_dir.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    summary = run_job(config(src, out, copy))
    assert summary.num_rows_skipped == 3 and summary.num_rows == len(TEXTS) - 3


def test_overwrite_reprocesses_everything(tiny_model_dir, loaded, tmp_path, reference):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_new_tokens=2), loaded=loaded)
    old_parts = {p.name for p in out.glob("part-*")}
    summary = run_job(config(src, out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert summary.num_rows == len(TEXTS) and summary.num_rows_skipped == 0
    assert output(out) == reference
    assert not old_parts & {p.name for p in out.glob("part-*")}
    entries = sorted(p.name for p in (out / MANIFEST_DIR).iterdir())
    assert json.loads((out / MANIFEST_DIR / entries[0]).read_text())["op"] == "begin"  # history dropped
    # --overwrite on the same config starts over too
    again = run_job(config(src, out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert again.num_rows == len(TEXTS)


def test_nothing_committed_yet_needs_no_overwrite(tiny_model_dir, loaded, tmp_path, monkeypatch):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"

    def die(current):
        raise Crash

    monkeypatch.setattr(local_files, "_fault_hook", die)
    with pytest.raises(Crash):  # dies at its first write: a begin entry, no rows
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    summary = run_job(config(src, out, tiny_model_dir, max_new_tokens=2), loaded=loaded)
    assert summary.num_rows == len(TEXTS)


def test_error_rows_are_retried_and_replaced(tiny_model_dir, loaded, tmp_path, reference):
    texts = list(TEXTS)
    texts[2], texts[11] = "", None  # error rows, in parts that also hold ok rows
    src = write_input(tmp_path / "in.parquet", texts)
    out = tmp_path / "out"
    first = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert first.num_rows_error == 2
    assert output(out)[2]["error"] == "prompt column 'text' is empty"
    # the same errors again: nothing is rewritten
    names = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}
    again = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert (again.num_rows_retried, again.num_rows_replaced, again.num_commits) == (2, 0, 0)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")} == names
    # --no-retry-errors keeps them without looking
    kept = run_job(config(src, out, tiny_model_dir, retry_errors=False), loaded=loaded)
    assert (kept.num_rows_retried, kept.num_rows_skipped) == (0, len(TEXTS))
    # the data is fixed; the same command replaces each error row by its new row
    write_input(src, TEXTS)
    fixed = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert (fixed.num_rows, fixed.num_rows_retried, fixed.num_rows_replaced) == (2, 2, 2)
    assert output(out) == reference
    state = load_manifest(out)
    state.check_integrity()
    assert not state.error_ids and len(state.ok_ids) == len(TEXTS)


def test_max_error_rate_counts_the_whole_output_and_withholds_success(tiny_model_dir, loaded, tmp_path):
    texts = list(TEXTS)
    for i in range(0, 23, 4):
        texts[i] = None
    src = write_input(tmp_path / "in.parquet", texts)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=10), loaded=loaded)
    with pytest.raises(ErrorRateExceeded, match="6 of 23 rows failed") as info:
        run_job(config(src, out, tiny_model_dir, max_error_rate=0.2), loaded=loaded)
    assert info.value.exit_code == 3 and not (out / SUCCESS_FILE).exists()
    assert len(output(out)) == 23
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["output_rows"] == 23 and summary["output_rows_error"] == 6 and not summary["complete"]


def test_duplicate_ids_are_refused_before_any_output(tiny_model_dir, loaded, tmp_path):
    src = write_input(tmp_path / "in.parquet", TEXTS[:5], ids=[1, 2, 3, 2, 5])
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"in.parquet, row 3, column 'id': duplicate id 2 \(first at .*in.parquet, "
                                         r"row 1\)"):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert not out.exists()


def test_foreign_parquet_in_the_output_dir_is_refused(tiny_model_dir, loaded, tmp_path):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"x": [1]}), out / "mine.parquet")
    with pytest.raises(OutputError, match="no batchgen manifest lists"):
        run_job(config(src, out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert (out / "mine.parquet").exists() and sorted(p.name for p in out.iterdir()) == ["mine.parquet"]


def test_parts_of_an_older_batchgen_are_replaced_only_with_overwrite(tiny_model_dir, loaded, tmp_path, reference):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    out.mkdir()
    old = out / "part-00000-0badc0de.parquet"
    pq.write_table(pa.table({"id": [0]}), old)
    with pytest.raises(OutputError, match="pass --overwrite"):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    run_job(config(src, out, tiny_model_dir, overwrite=True), loaded=loaded)
    assert not old.exists() and output(out) == reference


def test_status_of_a_finished_job_is_written_in_the_manifest(tiny_model_dir, loaded, tmp_path):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, commit_every_rows=None, rows_per_part=10), loaded=loaded)
    state = load_manifest(out)
    assert [len(p.ids) for p in state.parts.values()] == [10, 10, 3]
    stat = src.stat()
    assert state.inputs["inputs"] == [{"path": str(src), "num_rows": len(TEXTS), "identity": {
        "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "schema": state.inputs["inputs"][0]["identity"]["schema"],
        "num_rows": len(TEXTS), "digest": "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()[:16]}}]
    assert state.inputs["orphans"] == {"num_rows": 0, "examples": []}
    assert state.fingerprint["model_revision"] == loaded.revision and state.fingerprint["id_column"] == "id"


def test_an_engine_failure_keeps_the_rows_that_finished(tiny_model_dir, loaded, tmp_path, monkeypatch, reference):
    from batchgen.engine.engine import LLMEngine
    from batchgen.errors import EngineError

    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    real_step = LLMEngine.step
    steps = []

    def failing_step(self):
        steps.append(1)
        if len(steps) >= 10:  # from then on: the static fallback of a continuous window fails too
            raise EngineError("the engine fell over")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    with pytest.raises(EngineError):
        run_job(config(src, out, tiny_model_dir, commit_every_rows=1000), loaded=loaded)  # no commit on the way
    monkeypatch.setattr(LLMEngine, "step", real_step)
    committed = load_manifest(out).num_committed_rows
    assert committed > 0  # the rows finished before the failure were committed on the way out
    partial = json.loads((out / SUMMARY_FILE).read_text())
    assert partial["partial"] and partial["output_rows"] == committed and partial["num_rows"] > 0
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows_skipped == committed and output(out) == reference
