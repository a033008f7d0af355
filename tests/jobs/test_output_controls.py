"""vLLM's stop_token_ids, include_stop_str_in_output and skip_special_tokens through run_job on
the tiny random Llama (issue 35). Its byte-level tokenizer has ids 0-4 for specials and one id per
byte after them, so "every byte id" as stop_token_ids ends a row at its first byte token."""

from __future__ import annotations

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
