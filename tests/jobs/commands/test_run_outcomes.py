"""What a finished run tells a scheduler: exit 3 without _SUCCESS when most rows failed (the default
--max-error-rate), exit 2 before any load when --max-new-tokens leaves no room for a prompt, and one
answer for every empty input (exit 0, _SUCCESS, no model), or exit 2 under --no-allow-empty-input."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.model import loader
from batchgen.engine.model.context_length import context_tokens_from_files
from batchgen.errors import ConfigError, ErrorRateExceeded, InputError
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.plan import plan_job
from batchgen.jobs.commands.run import SUMMARY_FILE, run_job
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config


def job(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{"chat": False, "max_new_tokens": 3, **overrides})


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a job loads a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", refuse)


def test_a_job_whose_rows_mostly_failed_exits_3_without_success_by_default(tiny_model_dir, loaded, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["", "  ", "a b c"]}), src)  # two empty prompts: error rows
    out = tmp_path / "out"
    with pytest.raises(ErrorRateExceeded, match="2 of 3 rows failed, more than --max-error-rate 0.5"):
        run_job(job(src, out, tiny_model_dir), loaded=loaded)
    assert not (out / "_SUCCESS").exists() and len(committed_rows(out, "row_id")) == 3
    # the share is the output's, every run: a resume that keeps the error rows counts them again
    with pytest.raises(ErrorRateExceeded):
        run_job(job(src, out, tiny_model_dir, retry_errors=False), loaded=loaded)
    # --max-error-rate 1 accepts any share: the same output is complete
    summary = run_job(job(src, out, tiny_model_dir, retry_errors=False, max_error_rate=1.0), loaded=loaded)
    assert summary.complete and (out / "_SUCCESS").exists()
    # a rerun under the default policy takes the laxer run's _SUCCESS down with its exit 3
    with pytest.raises(ErrorRateExceeded):
        run_job(job(src, out, tiny_model_dir, retry_errors=False), loaded=loaded)
    assert not (out / "_SUCCESS").exists()
    # half the rows failing is within the default
    half = tmp_path / "half.parquet"
    pq.write_table(pa.table({"text": ["", "a b c"]}), half)
    summary = run_job(job(half, tmp_path / "half", tiny_model_dir), loaded=loaded)
    assert summary.complete and summary.output_rows_error == 1 and (tmp_path / "half" / "_SUCCESS").exists()


def test_the_context_length_read_from_files_is_the_loaded_models(tiny_model_dir, loaded):
    assert context_tokens_from_files(str(tiny_model_dir)) == loaded.max_context_tokens == 512


def test_max_new_tokens_filling_the_context_exits_2_before_the_model_loads(tiny_model_dir, tmp_path, no_model_load):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a b c"]}), src)
    out = tmp_path / "out"
    message = r"--max-new-tokens \(YAML max_new_tokens\) 512 leaves no room for the prompt .* \(512 tokens\)"
    with pytest.raises(ConfigError, match=message):
        run_job(job(src, out, tiny_model_dir, max_new_tokens=512))
    assert not out.exists()
    with pytest.raises(ConfigError, match=message):
        plan_job(job(src, None, tiny_model_dir, max_new_tokens=512))


def _empty_inputs(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "rows0.parquet")
    (tmp_path / "bytes0.parquet").write_bytes(b"")
    (tmp_path / "bytes0.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    return {"0-row Parquet": tmp_path / "rows0.parquet", "0-byte Parquet": tmp_path / "bytes0.parquet",
            "0-byte JSON Lines": tmp_path / "bytes0.jsonl", "blank JSON Lines": tmp_path / "blank.jsonl"}


@pytest.mark.parametrize("kind", ["0-row Parquet", "0-byte Parquet", "0-byte JSON Lines", "blank JSON Lines"])
def test_an_empty_input_finishes_with_success_and_no_model(kind, tiny_model_dir, tmp_path, no_model_load, caplog):
    src = _empty_inputs(tmp_path)[kind]
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="batchgen"):
        summary = run_job(job(src, out, tiny_model_dir, id_column="id" if "JSON" in kind else None))
    assert summary.empty_input and summary.complete and summary.output_rows == 0
    assert (out / "_SUCCESS").exists() and json.loads((out / SUMMARY_FILE).read_text())["empty_input"]
    assert load_manifest(out).num_committed_rows == 0
    assert "holds no rows" in caplog.text and summary.lines()[0].startswith("nothing to do: the input holds no rows")
    again = run_job(job(src, out, tiny_model_dir, id_column="id" if "JSON" in kind else None))  # a retried task
    assert again.complete and (out / "_SUCCESS").exists()
    assert plan_job(job(src, None, tiny_model_dir))["empty_input"]
    with pytest.raises(InputError, match="the input holds no rows .* --no-allow-empty-input"):
        run_job(job(src, tmp_path / "strict", tiny_model_dir, allow_empty_input=False))
    assert not (tmp_path / "strict").exists()


def test_an_empty_file_beside_others_adds_no_rows(tiny_model_dir, loaded, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a b c", "d e"]}), src)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    summary = run_job(job([src, empty], tmp_path / "out", tiny_model_dir, allow_empty_input=False), loaded=loaded)
    assert summary.complete and summary.output_rows == 2 and not summary.empty_input


def test_a_sharded_job_over_an_empty_input_finalizes_without_a_model(tiny_model_dir, tmp_path, no_model_load):
    """Every shard of an empty job answers as the whole job would (no model) and finalize takes them; a
    shard whose share alone is empty runs as any shard (tests/jobs/executors/test_workers.py)."""
    src = _empty_inputs(tmp_path)["0-row Parquet"]
    out = tmp_path / "out"
    for index in range(2):
        assert run_job(job(src, out, tiny_model_dir, num_shards=2, shard_index=index)).empty_input
    assert finalize_output(out)["rows"] == 0 and (out / "_SUCCESS").exists()
