"""A rerun of a finished --id-column job reads no weights: its prompts are compared
with the tokenizer alone; a changed prompt still loads the model and regenerates its row."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from batchgen.engine.model import loader
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = ["first row", "second row", "third row is longer"]


class WeightsRead(Exception):
    pass


def write_input(path, texts):
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": texts}), path)
    return path


def no_weights(monkeypatch):
    """Any model load from here on fails the test: load_model, and from_pretrained under it."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise WeightsRead("the model was loaded")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    return calls


def job(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, id_column="id", max_new_tokens=3, **overrides)


def test_finished_id_column_job_reruns_without_the_model(tiny_model_dir, loaded, tmp_path, monkeypatch):
    src = write_input(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    first = run_job(job(src, out, tiny_model_dir), loaded=loaded)
    assert first.num_rows == len(TEXTS) and first.complete
    before = committed_rows(out)
    refused = no_weights(monkeypatch)
    again = run_job(job(src, out, tiny_model_dir))  # no `loaded`: a model load would go through load_model
    assert again.nothing_to_do and again.num_rows == 0 and again.num_rows_skipped == len(TEXTS)
    assert refused == []
    assert committed_rows(out) == before


def test_a_changed_prompt_still_loads_the_model(tiny_model_dir, loaded, tmp_path, monkeypatch):
    src = write_input(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(job(src, out, tiny_model_dir), loaded=loaded)
    write_input(src, [TEXTS[0], "second row, edited", TEXTS[2]])
    refused = no_weights(monkeypatch)
    with pytest.raises(WeightsRead):
        run_job(job(src, out, tiny_model_dir))
    assert refused  # the edited row needs generating: the model was asked for



RERUN_IN_A_FRESH_PROCESS = """
import sys
from batchgen.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
print("MODELING", "transformers.modeling_utils" in sys.modules, code, file=sys.stderr)
"""


def test_a_finished_rerun_does_not_import_the_modeling_code(tiny_model_dir, loaded, tmp_path):
    """The finished rerun is what every retried Airflow task with nothing left pays: importing
    transformers' modeling code would be most of its time, for a model it never builds."""
    src = write_input(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(job(src, out, tiny_model_dir, chat=False, parse_special_tokens=True), loaded=loaded)  # the CLI's defaults
    args = ["run", "--input", str(src), "--output", str(out), "--model", str(tiny_model_dir), "--id-column", "id",
            "--device", "cpu", "--dtype", "float32", "--no-chat", "--max-new-tokens", "3",
            "--kv-cache-memory", "16MiB", "--quiet"]
    done = subprocess.run([sys.executable, "-c", RERUN_IN_A_FRESH_PROCESS, *args], capture_output=True, text=True,
                          timeout=300)
    assert "MODELING False 0" in done.stderr, done.stderr[-3000:]
