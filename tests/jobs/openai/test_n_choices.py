"""OpenAI Batch requests with `n`: one engine sample per choice, the line's `choices` indexed 0..n-1
(validated with the openai package's types), usage counting the prompt once; the Parquet output has
a row per choice keyed by (custom_id, sample_index); compact rewrites the same lines."""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchgen.errors import FingerprintMismatch
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from tests.jobs.openai.test_openai_batch_job import chat, completion, job, read_lines


def test_n_choices_round_trip(tmp_path, tiny_model_dir, loaded, one_thread):
    requests = [chat("c2", "Tell me a story", max_tokens=8, temperature=1.0, seed=5, n=2),
                completion("t3", "Once upon a time", max_tokens=6, temperature=0.9, n=3),
                chat("c1", "Hello", max_tokens=5, temperature=1.0, n=1),
                chat("bad", "Hello", n=0)]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir), loaded=loaded)
    out = tmp_path / "out"
    ok, errors = read_lines(out)
    assert set(ok) == {"c2", "t3", "c1"} and set(errors) == {"bad"}
    assert errors["bad"]["response"]["body"]["error"]["param"] == "n"
    table = ds.dataset(str(out), format="parquet", exclude_invalid_files=True).to_table().to_pylist()
    rows = {(r["custom_id"], r["sample_index"]): r for r in table}
    assert len(rows) == len(table) == 2 + 3 + 1 + 1, "a (custom_id, sample_index) appears twice"
    for cid, n, kind in (("c2", 2, ChatCompletion), ("t3", 3, Completion), ("c1", 1, ChatCompletion)):
        body = kind.model_validate(ok[cid]["response"]["body"])
        assert [c.index for c in body.choices] == list(range(n))
        texts = [c.message.content if kind is ChatCompletion else c.text for c in body.choices]
        assert texts == [rows[cid, i]["generated_text"] for i in range(n)]
        assert body.usage.prompt_tokens == rows[cid, 0]["num_prompt_tokens"]
        assert body.usage.completion_tokens == sum(rows[cid, i]["num_generated_tokens"] for i in range(n))
        if n > 1:
            assert len(set(texts)) == n, "the choices drew the same stream"
    before = (out / "output.jsonl").read_bytes()
    compact_output(out)
    assert sorted((out / "output.jsonl").read_bytes().splitlines()) == sorted(before.splitlines())


def test_a_resume_without_the_jobs_n_is_refused(tmp_path, tiny_model_dir, loaded, one_thread):
    """Batch input run with --n 2, then without it on more requests: the output already has
    sample_index either way, so only the fingerprint can tell the old requests' 2 choices from the
    new ones' 1; without it the rerun would mix them."""
    requests = [chat(f"c{i}", f"Hello {i}", max_tokens=3, temperature=1.0) for i in range(4)]
    run_job(job(tmp_path, requests[:2], model_dir=tiny_model_dir, n=2), loaded=loaded)
    with pytest.raises(FingerprintMismatch, match="n 2 -> 1") as e:
        run_job(job(tmp_path, requests, model_dir=tiny_model_dir), loaded=loaded)
    assert e.value.exit_code == 2
