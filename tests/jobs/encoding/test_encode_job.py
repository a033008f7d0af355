"""`batchgen run --task embed|score|classify`: whole jobs through the encode core into committed Parquet."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchgen.errors import FingerprintMismatch
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from tests.jobs.encode_fixtures import MAX_SEQ_LENGTH, reference_embeddings, save_tiny_encoder_dir
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.tiny import make_tokenizer, save_tiny_model_dir

TEXTS = ["the cat sat on the mat", "a", "hello, world!", "ab " * 100, "", None, "embedding rows by length",
         "short", "a longer sentence than most", "42"]


def write_texts(path, texts):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.string())}), path)
    return path


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_encoder_dir(tmp_path_factory.mktemp("encoder") / "tiny-st")


def test_embed_job_equals_sentence_transformers(tmp_path, encoder_dir):
    src = write_texts(tmp_path / "in.parquet", TEXTS)
    config = tiny_job_config(src, tmp_path / "out", encoder_dir, task="embed", id_column="id", batch_size=3)
    summary = run_job(config)
    rows = committed_rows(tmp_path / "out")
    assert sorted(rows) == list(range(len(TEXTS)))
    ok = [i for i, t in enumerate(TEXTS) if t]
    expected = reference_embeddings(encoder_dir, [TEXTS[i] for i in ok])
    for i, want in zip(ok, expected, strict=True):
        got = np.asarray(rows[i]["embedding"], dtype=np.float32)
        assert got.shape == want.shape
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.9999, i
        assert rows[i]["error"] is None and rows[i]["num_prompt_tokens"] >= 3
    assert rows[3]["prompt_truncated"] is True and rows[3]["num_prompt_tokens"] == MAX_SEQ_LENGTH
    assert rows[0]["prompt_truncated"] is False
    assert "is empty" in rows[4]["error"] and rows[4]["embedding"] is None
    assert "is null" in rows[5]["error"]
    schema = pq.read_schema(next((tmp_path / "out").glob("part-*.parquet")))
    assert schema.field("embedding").type == pa.list_(pa.field("item", pa.float32()), 32)
    assert "generated_text" not in schema.names
    assert (summary.num_rows, summary.num_rows_ok, summary.num_rows_error) == (10, 8, 2)
    assert summary.num_rows_truncated == 1 and summary.num_generated_tokens == 0
    assert summary.num_prompt_tokens == sum(rows[i]["num_prompt_tokens"] for i in ok)
    assert any(line.startswith("tokens:") and "prompt tok/s" in line for line in summary.lines())
    assert summary.engine["num_batches"] >= 3 and summary.engine["num_needed_tokens"] == summary.num_prompt_tokens
    assert (tmp_path / "out" / "_SUCCESS").is_file()
    live = job_status(tmp_path / "out")["live"]  # the metrics: one step record per encoder batch
    assert live["rows_finished"] == 10 and live["engine_steps"] == summary.engine["num_batches"]
    assert live["input_tokens_per_s_last_minute"] > 0 and live["tokens_generated"] == 0


def test_embed_long_rows_are_error_rows_with_on_long_prompt_error(tmp_path, encoder_dir):
    src = write_texts(tmp_path / "in.parquet", ["fits", "y " * 300])
    run_job(tiny_job_config(src, tmp_path / "out", encoder_dir, task="embed", on_long_prompt="error"))
    rows = list(committed_rows(tmp_path / "out", "row_id").values())
    by_error = sorted(rows, key=lambda r: r["error"] is not None)
    assert by_error[0]["error"] is None and by_error[0]["embedding"] is not None
    assert f"leaves room for {MAX_SEQ_LENGTH}" in by_error[1]["error"]


def test_embed_max_prompt_tokens_cuts_and_chat_messages_are_error_rows(tmp_path, encoder_dir):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 0, "text": "one two three four five six seven eight"}) + "\n"
                   + json.dumps({"id": 1, "text": [{"role": "user", "content": "hi"}]}) + "\n")
    run_job(tiny_job_config(src, tmp_path / "out", encoder_dir, task="embed", id_column="id", max_prompt_tokens=10))
    rows = committed_rows(tmp_path / "out")
    assert rows[0]["num_prompt_tokens"] == 10 and rows[0]["prompt_truncated"] is True
    want = reference_embeddings(encoder_dir, ["one two th"])[0]  # [CLS] o ##n ##e t ##w ##o t ##h [SEP]
    got = np.asarray(rows[0]["embedding"])
    assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.9999
    assert "holds chat messages; a embed job reads text" in rows[1]["error"] and rows[1]["embedding"] is None


def test_embed_rerun_skips_committed_rows_and_refuses_another_pooling(tmp_path, encoder_dir):
    src = write_texts(tmp_path / "in.parquet", TEXTS[:3])
    out = tmp_path / "out"
    run_job(tiny_job_config(src, out, encoder_dir, task="embed", id_column="id"))
    again = run_job(tiny_job_config(src, out, encoder_dir, task="embed", id_column="id"))
    assert again.nothing_to_do and again.num_rows_skipped == 3
    write_texts(src, TEXTS[:5])  # two more rows: a resume runs only them
    more = run_job(tiny_job_config(src, out, encoder_dir, task="embed", id_column="id"))
    assert (more.num_rows_skipped, more.num_rows) == (3, 2)
    assert sorted(committed_rows(out)) == list(range(5))
    with pytest.raises(FingerprintMismatch, match="pooling None -> .cls."):
        run_job(tiny_job_config(src, out, encoder_dir, task="embed", id_column="id", pooling="cls"))


def test_embed_dimensions_cut_the_vector(tmp_path, encoder_dir):
    src = write_texts(tmp_path / "in.parquet", TEXTS[:3])
    run_job(tiny_job_config(src, tmp_path / "out", encoder_dir, task="embed", id_column="id", dimensions=8))
    rows = committed_rows(tmp_path / "out")
    full = reference_embeddings(encoder_dir, TEXTS[:3])
    for i in range(3):
        got = np.asarray(rows[i]["embedding"], dtype=np.float32)
        want = full[i][:8] / np.linalg.norm(full[i][:8])  # cut, then normalized again (the model normalizes)
        assert got.shape == (8,) and np.allclose(got, want, atol=1e-4)


def _reference_logprob(model, ids: list[int], score_from: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return sum(float(logprobs[t - 1, ids[t]]) for t in range(score_from, len(ids)))


def test_score_job_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model_dir(tmp_path / "tiny-llama")
    texts = ["the quick brown fox", "jumps", "over the lazy dog again and again"]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "text": texts, "answer": [" yes", " no", None]}), src)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = make_tokenizer()

    run_job(tiny_job_config(src, tmp_path / "out", model_dir, task="score", id_column="id"))
    rows = committed_rows(tmp_path / "out")
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        want = _reference_logprob(model, ids, 1)
        assert rows[i]["num_scored_tokens"] == len(ids) - 1
        assert rows[i]["logprob"] == pytest.approx(want, rel=1e-4)
        assert rows[i]["perplexity"] == pytest.approx(np.exp(-want / (len(ids) - 1)), rel=1e-4)

    run_job(tiny_job_config(src, tmp_path / "cont", model_dir, task="score", id_column="id", score_column="answer"))
    rows = committed_rows(tmp_path / "cont")
    for i in (0, 1):
        prompt = tokenizer(texts[i])["input_ids"]
        cont = tokenizer([" yes", " no"][i], add_special_tokens=False)["input_ids"]
        assert rows[i]["num_scored_tokens"] == len(cont)
        assert rows[i]["logprob"] == pytest.approx(_reference_logprob(model, prompt + cont, len(prompt)), rel=1e-4)
    assert "'answer' is null" in rows[2]["error"] and rows[2]["logprob"] is None


def test_classify_job_equals_the_models_logits(tmp_path, encoder_dir):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    model_dir = tmp_path / "tiny-classifier"
    torch.manual_seed(1)
    config = BertConfig.from_pretrained(encoder_dir, num_labels=3, id2label={0: "bad", 1: "ok", 2: "good"},
                                        label2id={"bad": 0, "ok": 1, "good": 2})
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    tokenizer.save_pretrained(model_dir)
    texts = ["great stuff", "meh", "terrible, awful"]
    src = write_texts(tmp_path / "in.parquet", texts)
    run_job(tiny_job_config(src, tmp_path / "out", model_dir, task="classify", id_column="id"))
    rows = committed_rows(tmp_path / "out")
    for i, text in enumerate(texts):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        want = torch.softmax(logits, -1).numpy()
        assert np.allclose(rows[i]["scores"], want, atol=1e-5)
        assert rows[i]["label"] == config.id2label[int(want.argmax())]


def test_sharded_embed_job_finalizes_and_status_and_report_read_it(tmp_path, encoder_dir):
    from batchgen.jobs.commands.report import render_report
    from batchgen.jobs.commands.status import status_lines
    from batchgen.jobs.sharding.finalize import finalize_output

    src = write_texts(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    for index in range(2):
        run_job(tiny_job_config(src, out, encoder_dir, task="embed", id_column="id", num_shards=2,
                                shard_index=index))
    finalize_output(out)
    assert (out / "_SUCCESS").is_file()
    shard = out / "shard-0-of-2"
    lines = status_lines(job_status(shard))
    assert any("complete" in line for line in lines), lines
    assert any("task embed" in line and "max_new_tokens" not in line for line in lines), lines
    render_report(shard, dest=tmp_path / "report.html")
    assert (tmp_path / "report.html").stat().st_size > 0
    ids = [i for s in range(2) for i in committed_rows(out / f"shard-{s}-of-2")]
    assert sorted(ids) == list(range(len(TEXTS)))
