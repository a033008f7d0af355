"""`batchgen plan --task embed|score|classify`: rows tokenized as the run tokenizes them, cut at the
model's input limit, packed into batches; time from the machine profile; the output's size from the
task's columns (an embed job's dimension read from the model's files); no weights loaded."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel
from typer.testing import CliRunner

from batchgen.cli.app import app
from batchgen.errors import ConfigError
from batchgen.jobs.commands import plan_encode
from batchgen.jobs.commands.plan import plan_job, plan_lines
from batchgen.jobs.encoding.task_setup import load_encode_model_for
from batchgen.jobs.planning import profile
from batchgen.jobs.planning.encode_estimate import COMMON_BYTES_PER_ROW
from tests.jobs.encode_fixtures import HIDDEN_SIZE, MAX_SEQ_LENGTH, save_tiny_encoder_dir
from tests.jobs.helpers import tiny_job_config
from tests.tiny import make_tokenizer

TEXTS = ["a short one", "hello world", "xy " * 60, "mid length text here", "b " * 80]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_encoder_dir(tmp_path_factory.mktemp("st") / "tiny-st")


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS, "answer": [" yes"] * len(TEXTS)}), path)
    return path


@pytest.fixture(autouse=True)
def no_weights(monkeypatch, tmp_path):
    """A plan of these tasks reads files only: loading the model would fail the test."""
    def refuse(config):
        raise AssertionError("the plan loaded the model")
    monkeypatch.setattr(plan_encode, "load_encode_model_for", refuse)
    monkeypatch.setattr(profile, "profiles_dir", lambda: tmp_path / "profiles")  # the built-in profile


def test_embed_plan_counts_the_cut_tokens_and_sizes_the_vectors(src, encoder_dir):
    report = plan_job(tiny_job_config(src, None, encoder_dir, task="embed", id_column="id",
                                      max_num_batched_tokens=64))
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    lengths = [len(tokenizer(t)["input_ids"]) for t in TEXTS]
    assert report["task"] == "embed" and report["max_input_tokens"] == MAX_SEQ_LENGTH
    assert report["num_rows"] == len(TEXTS) and report["num_error_rows"] == 0
    assert report["prompt_tokens"]["total"] == sum(min(n, MAX_SEQ_LENGTH) for n in lengths)
    assert report["prompt_tokens"]["max"] == MAX_SEQ_LENGTH
    assert report["num_truncated_rows"] == sum(n > MAX_SEQ_LENGTH for n in lengths) == 2
    # packed by length under 64 tokens: the cut rows (48 each) run alone, the three short ones together
    assert report["num_batches"] == 3
    assert report["embedding_dim"] == HIDDEN_SIZE
    size = report["output_size"]
    assert size["task_columns_bytes"] == len(TEXTS) * (HIDDEN_SIZE * 4 + COMMON_BYTES_PER_ROW)
    assert size["copied_columns"].keys() == {"text", "answer"}
    # the built-in CPU profile scaled to the weights the safetensors headers count
    assert report["num_weights"] == sum(p.numel() for p in BertModel.from_pretrained(encoder_dir).parameters())
    assert report["profile"]["source"] == "built-in"
    prof = report["profile"]
    total_tokens = report["prompt_tokens"]["total"]
    assert report["estimated_seconds"] == pytest.approx(
        (3 * prof["step_overhead_ms"] + total_tokens * prof["ms_per_token"]) / 1000, abs=2e-3)
    text = "\n".join(plan_lines(report))
    assert f"{HIDDEN_SIZE}-dimension embedding" in text and "3 packed batches" in text, text

    cut = plan_job(tiny_job_config(src, None, encoder_dir, task="embed", id_column="id", dimensions=8))
    assert cut["embedding_dim"] == 8
    assert cut["output_size"]["task_columns_bytes"] == len(TEXTS) * (8 * 4 + COMMON_BYTES_PER_ROW)


def test_score_plan_with_a_continuation_column(src, tiny_model_dir):
    report = plan_job(tiny_job_config(src, None, tiny_model_dir, task="score", id_column="id", chat=False,
                                      score_column="answer"))
    tokenizer = make_tokenizer()
    answer = len(tokenizer(" yes", add_special_tokens=False)["input_ids"])
    assert report["task"] == "score" and report["embedding_dim"] is None
    assert report["max_input_tokens"] == load_encode_model_for(tiny_job_config(src, None, tiny_model_dir,
                                                                               task="score")).max_input_tokens
    assert report["prompt_tokens"]["total"] == sum(len(tokenizer(t)["input_ids"]) + answer for t in TEXTS)
    assert report["output_size"]["bytes_per_row"] == 8 + 4 + 8 + COMMON_BYTES_PER_ROW
    assert "its log-likelihood" in "\n".join(plan_lines(report))


def test_classify_plan_reads_the_labels(src, encoder_dir, tmp_path):
    model_dir = tmp_path / "tiny-classifier"
    config = BertConfig.from_pretrained(encoder_dir, num_labels=3, id2label={0: "bad", 1: "ok", 2: "good"},
                                        label2id={"bad": 0, "ok": 1, "good": 2})
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(encoder_dir).save_pretrained(model_dir)
    report = plan_job(tiny_job_config(src, None, model_dir, task="classify", id_column="id"))
    assert report["num_labels"] == 3
    assert report["max_input_tokens"] == load_encode_model_for(tiny_job_config(src, None, model_dir,
                                                                               task="classify")).max_input_tokens
    assert report["output_size"]["bytes_per_row"] == round((3 + 2 + 4) / 3) + 4 + 3 * 4 + COMMON_BYTES_PER_ROW


def test_calibrate_is_refused_for_a_task_that_generates_nothing(src, encoder_dir):
    with pytest.raises(ConfigError, match="--calibrate times generation steps"):
        plan_job(tiny_job_config(src, None, encoder_dir, task="embed"), calibrate=True)


def test_the_plan_command_takes_the_task_flags(src, encoder_dir):
    result = CliRunner().invoke(app, ["plan", "--input", str(src), "--model", encoder_dir, "--device", "cpu",
                                      "--task", "embed", "--dimensions", "16", "--no-normalize"])
    assert result.exit_code == 0, result.output
    assert "plan (--task embed): 5 rows" in result.output and "16-dimension embedding" in result.output


def test_the_plan_counts_the_tokens_the_run_runs(src, encoder_dir, tmp_path):
    from batchgen.jobs.commands.run import run_job
    from tests.jobs.helpers import committed_rows

    settings = dict(task="embed", id_column="id", max_num_batched_tokens=64, window_rows=3)
    report = plan_job(tiny_job_config(src, None, encoder_dir, **settings))
    summary = run_job(tiny_job_config(src, tmp_path / "out", encoder_dir, **settings))
    rows = committed_rows(tmp_path / "out").values()
    assert report["prompt_tokens"]["total"] == sum(r["num_prompt_tokens"] for r in rows)
    assert report["num_batches"] == summary.engine["num_batches"]
    assert report["max_input_tokens"] == load_encode_model_for(tiny_job_config(src, None, encoder_dir,
                                                                               **settings)).max_input_tokens
    assert report["num_truncated_rows"] == sum(bool(r["prompt_truncated"]) for r in rows)
