"""vLLM's stop_token_ids, include_stop_str_in_output and skip_special_tokens through run_job on
the tiny random Llama. Its byte-level tokenizer has ids 0-4 for specials and one id per
byte after them, so "every byte id" as stop_token_ids ends a row at its first byte token."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.tiny import BYTE_OFFSET, VOCAB_SIZE

BYTE_IDS = list(range(BYTE_OFFSET, VOCAB_SIZE))
TEXTS = ["one prompt", "another prompt", "a third, longer prompt than the others"]


def rows(tmp_path, loaded, model_dir, name, **settings) -> list[dict]:
    src = tmp_path / "in.parquet"
    if not src.exists():
        pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), src)
    out = tmp_path / name
    run_job(tiny_job_config(src, out, model_dir, id_column="id", chat=False, max_new_tokens=8, **settings),
            loaded=loaded)
    return list(committed_rows(out).values())


def test_stop_token_ids_end_rows_and_their_text_is_left_out(tmp_path, loaded, tiny_model_dir):
    stopped = rows(tmp_path, loaded, tiny_model_dir, "stopped", stop_token_ids=BYTE_IDS, ignore_eos=True)
    assert all(r["num_generated_tokens"] == 1 and r["finish_reason"] == "stop" for r in stopped), stopped
    assert all(r["generated_text"] == "" for r in stopped)
    kept = rows(tmp_path, loaded, tiny_model_dir, "kept", stop_token_ids=BYTE_IDS, ignore_eos=True,
                include_stop_str_in_output=True)
    assert all(r["num_generated_tokens"] == 1 and r["generated_text"] != "" for r in kept), kept


def test_skip_special_tokens_off_shows_them(tmp_path, loaded, tiny_model_dir):
    """min_tokens masks the stop ids (as EOS) for two tokens, so those two are specials."""
    settings = dict(stop_token_ids=BYTE_IDS, min_tokens=2)
    hidden = rows(tmp_path, loaded, tiny_model_dir, "hidden", **settings)
    assert all(r["num_generated_tokens"] == 3 and r["generated_text"] == "" for r in hidden), hidden
    shown = rows(tmp_path, loaded, tiny_model_dir, "shown", skip_special_tokens=False, **settings)
    assert all(r["generated_text"].startswith("<|") and r["generated_text"].count("<|") == 2 for r in shown), shown



VOWELS = "aeiou"


def token_id(tokenizer, char: str) -> int:
    (token,) = tokenizer.encode(char, add_special_tokens=False)
    return token


def test_allowed_token_ids_and_logit_bias_through_the_job(tmp_path, loaded, tiny_model_dir, tokenizer):
    """The YAML/flag forms: logit_bias keys as JSON strings, allowed ids as a list."""
    allowed = [token_id(tokenizer, c) for c in VOWELS]
    limited = rows(tmp_path, loaded, tiny_model_dir, "allowed", allowed_token_ids=allowed, ignore_eos=True)
    assert all(r["generated_text"] and set(r["generated_text"]) <= set(VOWELS) for r in limited), limited
    forced = rows(tmp_path, loaded, tiny_model_dir, "biased", ignore_eos=True,
                  logit_bias=json.dumps({str(token_id(tokenizer, "z")): 100}))
    assert all(r["generated_text"] == "z" * 8 for r in forced), forced


def test_a_per_row_logit_bias_from_the_sampling_column(tmp_path, loaded, tiny_model_dir, tokenizer):
    src = tmp_path / "cells.parquet"
    cells = [None, json.dumps({"logit_bias": {token_id(tokenizer, "k"): 100}}), '{"allowed_token_ids": ["x"]}']
    pq.write_table(pa.table({"id": [0, 1, 2], "text": TEXTS, "s": cells}), src)
    out = tmp_path / "cells"
    run_job(tiny_job_config(src, out, tiny_model_dir, id_column="id", chat=False, max_new_tokens=4, ignore_eos=True,
                            sampling_column="s"), loaded=loaded)
    by_id = committed_rows(out)
    assert by_id[1]["generated_text"] == "kkkk"
    assert by_id[0]["generated_text"] != "kkkk" and by_id[0]["finish_reason"] == "length"
    assert by_id[2]["finish_reason"] == "error" and "allowed_token_ids" in by_id[2]["error"]
