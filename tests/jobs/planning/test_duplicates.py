"""Duplicate prompts run once: copies of a greedy (or explicitly seeded) prompt are generated once
and written under every id, identical to what each would have generated; ids stay exactly-once
across a resume; rows whose seed derives from their id are never served from a copy."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.request import Request, SamplingParams
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.planning.duplicates import DuplicatePrompts, duplicate_key
from tests.jobs.helpers import committed_rows, tiny_job_config

DISTINCT = ["the cat sat on the mat", "a b c d e f g", "hello there, how are you", "one two three four five six"]
NUM_COPIES = 3


@pytest.fixture
def src(tmp_path):
    """Each distinct prompt NUM_COPIES times, shuffled, under ids 0..N-1."""
    texts = [t for t in DISTINCT for _ in range(NUM_COPIES)]
    random.Random(3).shuffle(texts)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=6, batch_size=4,
                                                          window_rows=5), **overrides})


def by_text(rows: dict) -> dict:
    texts: dict = {}
    for row in rows.values():
        texts.setdefault(row["text"], set()).add((row["generated_text"], row["finish_reason"],
                                                  row["num_generated_tokens"], row["prompt_hash"]))
    return texts


def test_copies_run_once_and_equal_an_undeduplicated_run(src, tmp_path, tiny_model_dir, loaded):
    deduped = run_job(config(src, tmp_path / "a", tiny_model_dir), loaded=loaded)
    plain = run_job(config(src, tmp_path / "b", tiny_model_dir, dedup=False), loaded=loaded)
    rows, plain_rows = committed_rows(tmp_path / "a"), committed_rows(tmp_path / "b")
    assert sorted(rows) == sorted(plain_rows) == list(range(len(DISTINCT) * NUM_COPIES))
    texts = by_text(rows)
    assert all(len(outputs) == 1 for outputs in texts.values()), "copies of a prompt differ"
    assert {i: r["generated_text"] for i, r in rows.items()} == {i: r["generated_text"] for i, r in plain_rows.items()}
    # the engine sampled the distinct prompts' tokens only (windows of 5 rows: copies in later windows
    # are served from the finished leaders)
    distinct_tokens = sum(next(iter(outputs))[2] for outputs in texts.values())
    assert deduped.num_sampled_tokens == distinct_tokens < plain.num_sampled_tokens
    assert deduped.num_rows_from_duplicates == len(DISTINCT) * (NUM_COPIES - 1)
    assert plain.num_rows_from_duplicates == 0
    assert "served from a duplicate prompt" in deduped.lines()[0]


def test_a_resume_writes_every_copy_exactly_once(src, tmp_path, tiny_model_dir, loaded):
    out = tmp_path / "out"
    first = run_job(config(src, out, tiny_model_dir, max_rows=5, commit_every_rows=2), loaded=loaded)
    assert first.num_rows == 5
    rest = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert rest.num_rows_skipped == 5 and rest.num_rows == len(DISTINCT) * NUM_COPIES - 5
    rows = committed_rows(out)  # fails on an id written twice
    assert sorted(rows) == list(range(len(DISTINCT) * NUM_COPIES))
    assert all(len(outputs) == 1 for outputs in by_text(rows).values())


def test_rows_sampled_under_their_own_seed_are_not_copies(src, tmp_path, tiny_model_dir, loaded):
    summary = run_job(config(src, tmp_path / "out", tiny_model_dir, temperature=1.0), loaded=loaded)
    assert summary.num_rows_from_duplicates == 0
    rows = committed_rows(tmp_path / "out")
    assert summary.num_sampled_tokens == sum(r["num_generated_tokens"] for r in rows.values())
    assert any(len(outputs) > 1 for outputs in by_text(rows).values()), "each row draws its own tokens"


def request(prompt, **sampling):
    return Request("r", prompt, SamplingParams(**sampling))


def test_which_rows_share_a_key():
    greedy = duplicate_key(request([1, 2, 3], seed=1), explicit_seed=False)
    assert greedy is not None and greedy == duplicate_key(request([1, 2, 3], seed=2), explicit_seed=False)
    assert greedy != duplicate_key(request([1, 2, 4]), explicit_seed=False)
    assert greedy != duplicate_key(request([1, 2, 3], max_new_tokens=7), explicit_seed=False)
    assert duplicate_key(request([1, 2, 3], temperature=1.0, seed=5), explicit_seed=False) is None
    seeded = duplicate_key(request([1, 2, 3], temperature=1.0, seed=5), explicit_seed=True)
    assert seeded is not None and seeded != duplicate_key(request([1, 2, 3], temperature=1.0, seed=6),
                                                          explicit_seed=True)
    assert duplicate_key(request([1, 2, 3], n=2), explicit_seed=False) is None


def test_the_finished_cache_is_bounded_by_tokens():
    from batchgen.engine.request import Completion, FinishReason

    cache = DuplicatePrompts(max_cached_tokens=10)
    for i in range(5):
        key = bytes([i])
        assert cache.admit(None, Request(str(i), [i], SamplingParams()), key)
        done = [Completion(str(i), [1, 2, 3, 4], "x", FinishReason.LENGTH, 1)]
        assert list(cache.served(str(i), done)) == []
    assert cache.num_cached_tokens <= 10 and list(cache.finished) == [bytes([3]), bytes([4])]
