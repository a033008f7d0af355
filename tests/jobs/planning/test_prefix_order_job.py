"""--prefix-order through run_job on the tiny float32 model: several questions per document, shuffled,
give the same greedy rows as input order, and every shareable prompt token comes from the prefix
cache, in both modes, with chunked prefill and windows smaller than a look-ahead; the summary shows
it (and `batchgen report`), as do the metrics files and Prometheus, and `batchgen plan` counts it
and estimates the time with it."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgen.jobs.commands.plan import plan_job, plan_lines
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.planning import profile
from batchgen.monitor.report import build_job_report
from batchgen.monitor.store import metrics_dir
from batchgen.monitor.totals import Totals
from tests.jobs.helpers import committed_rows, tiny_job_config

NUM_DOCS, NUM_QUESTIONS = 5, 3


@pytest.fixture
def src(tmp_path):
    rng = random.Random(4)
    docs = ["".join(rng.choice("abcdefghij klmnop") for _ in range(70)) for _ in range(NUM_DOCS)]
    texts = [f"{d}\nQ{q}: what about {q * 7}?" for d in docs for q in range(NUM_QUESTIONS)]
    rng.shuffle(texts)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=5, batch_size=8),
                                                   **overrides})


def outputs(out) -> dict:
    return {i: (r["generated_text"], r["num_generated_tokens"], r["finish_reason"])
            for i, r in committed_rows(out).items()}


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_grouped_rows_give_the_same_output_and_take_every_shareable_token_from_the_cache(
        src, tmp_path, tiny_model_dir, loaded, mode):
    # windows of 4 rows: a document's 3 rows sit in different windows of the input; a 32-token step
    # budget prefills each ~90-token prompt in chunks
    settings = dict(mode=mode, window_rows=4, max_num_batched_tokens=32)
    grouped = run_job(config(src, tmp_path / "a", tiny_model_dir, **settings), loaded=loaded)
    plain = run_job(config(src, tmp_path / "b", tiny_model_dir, prefix_order=False, **settings), loaded=loaded)
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")
    assert len(outputs(tmp_path / "a")) == NUM_DOCS * NUM_QUESTIONS
    # each document's 70+ shared bytes are 4 full 16-token blocks, for its 2 rows after the first
    assert grouped.num_shareable_prefix_tokens == plain.num_shareable_prefix_tokens == NUM_DOCS * 2 * 4 * 16
    assert grouped.num_prefix_hit_prompt_tokens == grouped.num_shareable_prefix_tokens
    assert grouped.num_windows_static + grouped.num_windows_continuous == NUM_DOCS  # a window per document
    assert "prefix: 640 of 640 shareable prompt tokens came from the prefix cache (100%)" in grouped.lines()
    assert grouped.to_dict()["num_prefix_hit_prompt_tokens"] == 640
    facts = dict(build_job_report(tmp_path / "a").facts)  # batchgen report, from _summary.json
    assert facts["shared prompts (last run)"].startswith("640 of 640 shareable prefix tokens from the prefix cache")


def test_in_input_order_rows_admitted_together_compute_their_document_each(src, tmp_path, tiny_model_dir, loaded):
    plain = run_job(config(src, tmp_path / "b", tiny_model_dir, prefix_order=False, batch_size=16), loaded=loaded)
    grouped = run_job(config(src, tmp_path / "a", tiny_model_dir, batch_size=16), loaded=loaded)
    assert plain.num_prefix_hit_prompt_tokens < plain.num_shareable_prefix_tokens
    assert grouped.num_prefix_hit_prompt_tokens == grouped.num_shareable_prefix_tokens
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")


def test_plan_counts_the_shared_prefixes_and_copies_and_estimates_the_time_with_them(
        src, tmp_path, tiny_model_dir, loaded, monkeypatch):
    monkeypatch.setattr(profile, "profiles_dir", lambda: tmp_path / "profiles")
    table = pq.read_table(src)
    texts = table.column("text").to_pylist()
    with_copies = tmp_path / "copies.parquet"  # two rows twice more: --dedup serves them
    pq.write_table(pa.table({"id": list(range(len(texts) + 2)), "text": texts + texts[:2]}), with_copies)
    plan_job(config(with_copies, tmp_path / "o", tiny_model_dir), loaded=loaded, calibrate=True)  # stores a profile
    grouped = plan_job(config(with_copies, tmp_path / "o", tiny_model_dir), loaded=loaded)
    plain = plan_job(config(with_copies, tmp_path / "o", tiny_model_dir, prefix_order=False, dedup=False),
                     loaded=loaded)
    assert grouped["shareable_prefix_tokens"] == NUM_DOCS * 2 * 4 * 16  # the copies' own are not run
    assert grouped["rows_from_duplicates"] == 2 and plain["rows_from_duplicates"] == 0
    assert plain["shareable_prefix_tokens"] > grouped["shareable_prefix_tokens"]  # the copies run there
    assert grouped["estimated_seconds"] < plain["estimated_seconds"]
    assert any(line.startswith(f"shared prompts: {NUM_DOCS * 2 * 4 * 16} prompt tokens repeat another row's prefix, "
                               "computed once") and "2 rows repeat another's prompt" in line
               for line in plan_lines(grouped))


def test_metrics_files_and_prometheus_count_the_shared_prefixes_and_copies_as_the_summary(
        src, tmp_path, tiny_model_dir, loaded):
    texts = pq.read_table(src).column("text").to_pylist()
    with_copies = tmp_path / "copies.parquet"  # two rows twice more: --dedup serves them
    pq.write_table(pa.table({"id": list(range(len(texts) + 2)), "text": texts + texts[:2]}), with_copies)
    prom = tmp_path / "job.prom"
    summary = run_job(config(with_copies, tmp_path / "o", tiny_model_dir, metrics_textfile=str(prom)), loaded=loaded)
    figures = (summary.num_shareable_prefix_tokens, summary.num_prefix_hit_prompt_tokens,
               summary.num_rows_from_duplicates)
    assert figures == (NUM_DOCS * 2 * 4 * 16, NUM_DOCS * 2 * 4 * 16, 2)
    totals = Totals.from_dir(metrics_dir(tmp_path / "o"))  # the per-second rows records, summed
    assert (totals.num_shareable_prefix_tokens, totals.num_prefix_hit_prompt_tokens,
            totals.num_rows_from_duplicates) == figures
    values = {s.name: s.value for family in text_string_to_metric_families(prom.read_text()) for s in family.samples}
    assert (values["batchgen_shareable_prefix_tokens_total"], values["batchgen_prefix_hit_prompt_tokens_total"],
            values["batchgen_rows_from_duplicates_total"]) == figures
