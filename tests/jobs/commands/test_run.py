"""run_job end to end: greedy output equals transformers' generate, per-row seeds, stop strings,
error rows, the summary, and what happens to the output directory when a job cannot start.

Prompts are built with no chat template and no template, so a row's prompt is exactly
tokenizer(text) with special tokens: the reference can build the same ids without the job's code.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.engine.model.loader import load_model
from batchgen.errors import ConfigError, ErrorRateExceeded, OutputError
from batchgen.jobs.commands.run import SUMMARY_FILE, run_job
from batchgen.jobs.pipeline.core import row_seed
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 12
# 1 to 144 bytes (= tokens): single-token prompts, multi-byte UTF-8, and prompts longer than one
# 64-token step budget so the continuous policy has to prefill them in chunks.
PROMPTS = [
    "a", "Hi", "Hello world", "The quick brown fox jumps over the lazy dog", "x" * 100, "naïve café ☕",
    "1234567890", "Lorem ipsum dolor sit amet, consectetur", "?", "zzzz zzzz", "Once upon a time, " * 8,
]


@pytest.fixture(scope="module")
def loaded_models(tiny_model_dir, eos_model_dir):
    cache = {}

    def get(name):
        if name not in cache:
            path = {"plain": tiny_model_dir, "eos": eos_model_dir}[name]
            cache[name] = (path, load_model(str(path), device="cpu", dtype="float32"))
        return cache[name]

    return get


def write_prompts(path, texts, **columns):
    pq.write_table(pa.table({"text": texts, **columns}), path)
    return path


def job_config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(chat=False, max_new_tokens=MAX_NEW), **overrides})


def read_rows(out) -> dict:
    return committed_rows(out, "row_id")


@functools.cache
def reference_generate(model_dir, tokenizer, prompts, max_new_tokens):
    """Greedy continuations from an independently loaded transformers model: (new ids incl. EOS, text)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32,
                                                 local_files_only=True).eval()
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[0, len(ids):].tolist()
        if tokenizer.eos_token_id in new:  # generate pads after EOS; the job counts EOS itself
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        results.append((ids, new, tokenizer.decode(new, skip_special_tokens=True)))
    return results


@pytest.mark.parametrize(("model_name", "mode", "batch_size"), [
    ("plain", "continuous", 3), ("eos", "continuous", 3), ("eos", "static", 4),
])
def test_greedy_job_output_equals_model_generate(loaded_models, tokenizer, tmp_path, model_name, mode,
                                                 batch_size):
    model_dir, loaded = loaded_models(model_name)
    src = write_prompts(tmp_path / "prompts.parquet", PROMPTS)
    config = job_config(src, tmp_path / "out", model_dir, mode=mode, batch_size=batch_size,
                        max_num_batched_tokens=64)
    summary = run_job(config, loaded=loaded)
    assert summary.num_rows == summary.num_rows_ok == len(PROMPTS)

    rows = read_rows(tmp_path / "out")
    expected = reference_generate(model_dir, tokenizer, tuple(PROMPTS), MAX_NEW)
    reasons = []
    for i, (prompt_ids, new_ids, text) in enumerate(expected):
        row = rows[f"prompts.parquet:{i}"]
        assert row["num_prompt_tokens"] == len(prompt_ids), i
        assert row["num_generated_tokens"] == len(new_ids), (i, row, new_ids)
        assert row["generated_text"] == text, (i, row["generated_text"], text)
        stopped = new_ids[-1] == tokenizer.eos_token_id
        assert row["finish_reason"] == ("stop" if stopped else "length"), i
        reasons.append(row["finish_reason"])
    if model_name == "eos":  # the comparison covers both ways a row ends
        assert set(reasons) == {"stop", "length"}, reasons


def test_sampled_rows_do_not_depend_on_their_batch(loaded_models, tmp_path):
    """Each row's seed derives from the job seed and its id: batch size and neighbours change nothing."""
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", PROMPTS[:6])
    texts = {}
    for name, overrides in (("one", dict(batch_size=1)), ("six", dict(batch_size=6)),
                            ("static", dict(batch_size=4, mode="static")), ("seed8", dict(seed=8))):
        config = job_config(src, tmp_path / name, model_dir, **{"temperature": 1.0, "top_k": 50, "seed": 7,
                                                               **overrides})
        run_job(config, loaded=loaded)
        texts[name] = {k: r["generated_text"] for k, r in read_rows(tmp_path / name).items()}
    assert texts["one"] == texts["six"] == texts["static"]
    assert texts["seed8"] != texts["one"]


def test_row_seed_is_stable_and_per_row():
    assert row_seed(0, "a.parquet:1") == row_seed(0, "a.parquet:1")
    assert len({row_seed(0, "a.parquet:1"), row_seed(0, "a.parquet:2"), row_seed(1, "a.parquet:1"),
                row_seed(0, 1)}) == 4
    assert 0 <= row_seed(123, "x") < 2**63


def test_stop_string_cuts_the_text(loaded_models, tmp_path):
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", PROMPTS)
    run_job(job_config(src, tmp_path / "free", model_dir), loaded=loaded)
    free = read_rows(tmp_path / "free")
    # a stop string taken from inside one row's greedy text: an ASCII character after the first
    row_id, stop = next((k, ch) for k, r in sorted(free.items()) for ch in r["generated_text"][1:]
                        if ch.isascii() and ch.isalnum())
    run_job(job_config(src, tmp_path / "stopped", model_dir, stop=[stop]), loaded=loaded)
    stopped = read_rows(tmp_path / "stopped")
    for key, row in free.items():
        text = row["generated_text"]
        if stop in text:
            assert stopped[key]["generated_text"] == text[: text.index(stop)]
            assert stopped[key]["finish_reason"] == "stop"
            assert stopped[key]["num_generated_tokens"] <= row["num_generated_tokens"]
        else:
            assert stopped[key] == row | {"generated_text": text}
    assert stopped[row_id]["finish_reason"] == "stop"


def test_error_rows_summary_and_parts(loaded_models, tmp_path):
    model_dir, loaded = loaded_models("plain")
    texts = ["one", None, "three", "", "five", "  "]
    src = write_prompts(tmp_path / "in.parquet", texts, n=list(range(6)))
    out = tmp_path / "out"
    summary = run_job(job_config(src, out, model_dir, rows_per_part=4), loaded=loaded)
    assert (summary.num_rows, summary.num_rows_ok, summary.num_rows_error) == (6, 3, 3)
    assert summary.num_parts_written == 2 == len(list(out.glob("*.parquet")))
    rows = read_rows(out)
    assert sum(r["finish_reason"] == "error" for r in rows.values()) == 3
    assert summary.num_generated_tokens == sum(r["num_generated_tokens"] for r in rows.values())
    assert summary.num_prompt_tokens == sum(len(t) for t in ("one", "three", "five"))
    on_disk = json.loads((out / SUMMARY_FILE).read_text())
    assert on_disk["num_rows"] == 6 and on_disk["num_rows_error"] == 3
    assert not list(out.glob(".*"))  # no temp files left


def test_max_error_rate(loaded_models, tmp_path):
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", ["a", None, "c", None])
    run_job(job_config(src, tmp_path / "ok", model_dir, max_error_rate=0.5), loaded=loaded)
    with pytest.raises(ErrorRateExceeded, match="2 of 4 rows failed") as info:
        run_job(job_config(src, tmp_path / "bad", model_dir, max_error_rate=0.25), loaded=loaded)
    assert info.value.exit_code == 3
    assert len(read_rows(tmp_path / "bad")) == 4  # the output is still complete


def test_rerun_on_finished_output_changes_nothing(loaded_models, tmp_path):
    """A second run on a finished output refuses or resumes; either way no row is lost, doubled or changed."""
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", ["a", "b"])
    out = tmp_path / "out"
    run_job(job_config(src, out, model_dir), loaded=loaded)
    before = read_rows(out)
    try:
        run_job(job_config(src, out, model_dir), loaded=loaded)
    except OutputError as e:
        assert "output" in str(e)
    assert read_rows(out) == before


def test_failed_start_leaves_no_directory(loaded_models, tmp_path):
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", ["a"])
    out = tmp_path / "nested" / "out"
    # a mistake only the model shows (no chat template for --system), found after the lock was taken;
    # --no-chat --system itself is refused before anything (config_rules)
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="system prompt"):
        run_job(job_config(src, out, model_dir, system="Be brief.", chat=None),
                loaded=dataclasses.replace(loaded, tokenizer=tokenizer))
    assert not out.exists()


def test_output_dir_that_exists_empty_is_used(loaded_models, tmp_path):
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    out.mkdir()
    (out / ".part-00000-deadbeef.parquet.tmp").write_bytes(b"left by a crashed run")
    run_job(job_config(src, out, model_dir), loaded=loaded)
    assert len(read_rows(out)) == 3
    assert not list(out.glob(".*.tmp"))


def test_progress_ends_with_every_row_and_its_tokens(loaded_models, tmp_path, caplog):
    """The last progress line (written when the job ends) counts every row, 100%, no time left, and
    every prompt and generated token."""
    model_dir, loaded = loaded_models("plain")
    src = write_prompts(tmp_path / "in.parquet", [f"row {i}" for i in range(6)], n=[3, 9, 1, 12, 5, 7])
    caplog.set_level(logging.INFO, logger="batchgen")
    run_job(job_config(src, tmp_path / "out", model_dir, ignore_eos=True, max_new_tokens_column="n",
                       log_every_s=30), loaded=loaded)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rows ")]
    assert lines, "the job ends with a progress line"
    assert lines[-1].startswith("rows 6/6 (100%), elapsed ") and ", ETA 0.0s, " in lines[-1], lines[-1]
    assert lines[-1].endswith(" 0 errors; 30 prompt and 37 generated tokens"), lines[-1]  # "row i": 5 bytes
