"""--dedup in embed/score/classify jobs: an input equal to an earlier one runs once, every row is still
written under its own id, with the result a run of its own gives."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.encode.encoder import EncodeRequest, EncodeResult
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.encoding.encode_duplicates import EncodeDuplicates
from tests.jobs.helpers import committed_rows, tiny_job_config


@pytest.mark.parametrize("budget", [None, 16], ids=["one-window", "windows-of-256-tokens"])
def test_repeated_texts_are_scored_once(tmp_path, tiny_model_dir, budget, monkeypatch):
    unique = [f"text {i}: " + "the cat sat " * (5 + i) for i in range(5)]  # 70 to 120 tokens
    texts = unique + unique[:3] + unique[:2] + [unique[0]]  # 11 rows, 5 distinct, 6 copies
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), src)

    def run(out, dedup, **extra):
        config = tiny_job_config(src, tmp_path / out, tiny_model_dir, task="score", id_column="id", chat=False,
                                 dedup=dedup, **extra)
        return run_job(config), committed_rows(tmp_path / out)

    admitted = []
    admit = EncodeDuplicates.admit
    monkeypatch.setattr(EncodeDuplicates, "admit", lambda self, r: admitted.append(admit(self, r)) or admitted[-1])
    # planning windows of 4 rows; with a 16-token budget the encoder runs a window of its own (16 budgets)
    # before it pulls the next rows, so later copies come from finished leaders, not running ones
    summary, rows = run("dedup", True, window_rows=4, max_num_batched_tokens=budget)
    alone, rows_alone = run("alone", False)
    assert sorted(rows) == sorted(rows_alone) == list(range(len(texts)))
    assert summary.num_rows_from_duplicates == 6 and alone.num_rows_from_duplicates == 0
    from_finished = sum(isinstance(a, EncodeResult) for a in admitted)
    assert (from_finished == 0) if budget is None else (0 < from_finished < 6)
    assert summary.engine["num_needed_tokens"] == sum(rows[i]["num_prompt_tokens"] for i in range(len(unique)))
    assert alone.engine["num_needed_tokens"] == sum(r["num_prompt_tokens"] for r in rows_alone.values())
    for i, row in rows.items():
        assert row["error"] is None and row["prompt_hash"] == rows_alone[i]["prompt_hash"]
        assert row["logprob"] == pytest.approx(rows_alone[i]["logprob"], rel=1e-5)
        assert row["logprob"] == rows[unique.index(texts[i])]["logprob"]  # the leader's very result


def test_a_copy_waits_on_its_running_leader_or_takes_the_finished_result():
    dup = EncodeDuplicates(max_cached_tokens=5)
    leader, copy = EncodeRequest("0", (1, 2, 3)), EncodeRequest("1", (1, 2, 3))
    assert dup.admit(leader) is True and dup.admit(copy) is False
    assert dup.admit(EncodeRequest("2", (1, 2, 3), score_from=2)) is True  # other settings: another input
    result = EncodeResult("0", 3, logprob=-4.0, num_scored_tokens=2)
    assert dup.served(result) == [EncodeResult("1", 3, logprob=-4.0, num_scored_tokens=2)]
    assert dup.admit(EncodeRequest("3", (1, 2, 3))) == EncodeResult("3", 3, logprob=-4.0, num_scored_tokens=2)
    assert dup.served(EncodeResult("2", 3, logprob=-1.0, num_scored_tokens=1)) == []
    assert dup.admit(EncodeRequest("4", (9,) * 6)) is True
    dup.served(EncodeResult("4", 6, logprob=-9.0, num_scored_tokens=5))  # longer than the cache holds
    assert dup.admit(EncodeRequest("5", (9,) * 6)) is True
    assert dup.num_inputs_served == 2 and dup.num_cached_tokens <= 5
