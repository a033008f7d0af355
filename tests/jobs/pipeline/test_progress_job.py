"""The progress display over a real prefill-heavy job (long prompts, two output tokens, the tiny
model): the --quiet lines and the bar reach every row and 100%, show prompt tokens/s while the
prompts are prefilled, and the ETA stays within 2x of the time the job really had left."""

from __future__ import annotations

import io
import logging
import random
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.model.loader import load_model
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.pipeline import progress as progress_module
from tests.jobs.helpers import tiny_job_config

NUM_ROWS = 48
PROMPT_CHARS = 450  # one token a byte: 450 prompt tokens a row, against 2 output tokens
LINE = re.compile(r"rows (\d+)/(\d+) \((\d+)%\), elapsed ([\d.]+)s, ETA ([\d.]+|\?)s?, input ([\d.?]+) tok/s, "
                  r"output ([\d.?]+) tok/s, (\d+) errors; (\d+) prompt and (\d+) generated tokens")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def prefill_heavy(tiny_model_dir, tmp_path_factory):
    """The loaded model, warmed by the same job once (the first forward calls of each shape carry
    one-time work, oneDNN's kernels for it among them, that a job of this size does not amortize),
    and a prefill-heavy input."""
    tmp = tmp_path_factory.mktemp("prefill-heavy")
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    rng = random.Random(0)
    src = tmp / "in.parquet"
    pq.write_table(pa.table({"text": ["".join(rng.choice("abcdefgh ") for _ in range(PROMPT_CHARS))
                                      for _ in range(NUM_ROWS)]}), src)
    run_job(job_config(src, tmp / "warm", tiny_model_dir), loaded=loaded)
    return tiny_model_dir, loaded, src


def job_config(src, out, model_dir, **overrides):
    # 8 sequences and 32 tokens a step: each prompt is prefilled over many steps, as long prompts are
    return tiny_job_config(src, out, model_dir, **{**dict(
        chat=False, max_new_tokens=2, ignore_eos=True, batch_size=8, max_num_batched_tokens=32, mode="continuous"),
        **overrides})


def test_quiet_lines_reach_every_row_show_prefill_and_an_eta_within_2x(prefill_heavy, tmp_path, caplog):
    model_dir, loaded, src = prefill_heavy
    caplog.set_level(logging.INFO, logger="batchgen")
    run_job(job_config(src, tmp_path / "out", model_dir, log_every_s=0), loaded=loaded)
    lines = [(r.created, LINE.fullmatch(r.getMessage())) for r in caplog.records if r.getMessage().startswith("rows ")]
    assert lines and all(m is not None for _, m in lines), [r.getMessage() for r in caplog.records]
    last = lines[-1][1]
    assert last.group(1, 2, 3, 5) == (str(NUM_ROWS), str(NUM_ROWS), "100", "0.0"), last.group(0)
    assert int(last.group(9)) == NUM_ROWS * PROMPT_CHARS and int(last.group(10)) == NUM_ROWS * 2
    # prefill shows: while prompts are left, every line after the first step gives their rate
    prefill = [m for _, m in lines if 0 < int(m.group(9)) < NUM_ROWS * PROMPT_CHARS]
    assert len(prefill) >= 3 and all(m.group(6) != "?" and float(m.group(6)) > 0 for m in prefill), \
        [m.group(0) for _, m in lines]
    end = next(t for t, m in lines if m.group(1) == str(NUM_ROWS))  # the first line with every row done
    checked = 0
    for t, m in lines:
        left = end - t
        # once 10% of the work (nearly all of it prompts) is done; the last 0.25 s are within the
        # lines' own 0.05 s ticks
        if int(m.group(9)) < 0.1 * NUM_ROWS * PROMPT_CHARS or left < 0.25:
            continue
        eta = float(m.group(5))
        assert left / 2 <= eta <= 2 * left, (m.group(0), f"{left:.2f} s really left")
        checked += 1
    assert checked >= 5, checked


def test_bar_fills_over_rows_to_100_percent(prefill_heavy, tmp_path, monkeypatch):
    model_dir, loaded, src = prefill_heavy
    terminal = FakeTerminal()
    monkeypatch.setattr(progress_module, "terminal_columns", lambda stream: 120)
    monkeypatch.setattr(progress_module, "BAR_REFRESH_S", 0.05)
    monkeypatch.setattr(sys, "stderr", terminal)
    run_job(job_config(src, tmp_path / "out", model_dir, quiet=False), loaded=loaded)
    frames = [f.strip() for f in terminal.getvalue().split("\r") if f.strip()]
    assert frames[-1].startswith("rows: 100%|") and f"| {NUM_ROWS}/{NUM_ROWS} [" in frames[-1], frames[-1]
    assert "<00:00, input " in frames[-1] and "0 errors]" in frames[-1], frames[-1]
    # while the prompts are prefilled: rows to go, prompt tokens/s shown, a time left
    prefill = [f for f in frames if f"/{NUM_ROWS} [" in f and f"| {NUM_ROWS}/" not in f and "input ? " not in f]
    assert prefill and all("<?," not in f and "input 0.0 " not in f for f in prefill), frames
    assert not any(stray in terminal.getvalue() for stray in (", ,", "[, ", ", ]")), frames


ENGINE_INTERNALS = ("attention: ", "KV cache", "CPU: ", "compute thread", "linear weights", "fused CPU",
                    "built the CPU kernels", "for the rows to come")


def test_start_up_says_what_a_user_needs(tiny_model_dir, tmp_path, caplog):
    """Before the first progress line, INFO says what loads and how long it took and sums the
    engine up in one line; its internals are DEBUG lines."""
    caplog.set_level(logging.DEBUG, logger="batchgen")
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a short prompt"]}), src)
    run_job(job_config(src, tmp_path / "out", tiny_model_dir, log_every_s=3600), loaded=loaded)
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    start_up = info[:next(i for i, m in enumerate(info) if m.startswith("rows "))]
    assert start_up[0] == f"loading model {tiny_model_dir} ..."
    assert any(m.startswith(f"loading model {tiny_model_dir}: done in ") for m in start_up), start_up
    assert len(start_up) <= 6, start_up
    assert sum(m.startswith("engine: ") for m in start_up) == 1, start_up
    assert not [m for m in start_up if m.startswith(ENGINE_INTERNALS)], start_up
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("attention: ") for m in debug)  # still there for whoever asks (BATCHGEN_LOG_LEVEL)
