"""The output-length predictor: priors, exact lengths, online learning, its error, persistence."""

from __future__ import annotations

import errno
import json
import math
import os
import random

import pytest

from batchgen.jobs.planning import length
from batchgen.jobs.planning.length import (
    BIN_SAMPLES,
    GLOBAL_SAMPLES,
    LENGTH_MODEL_FILE,
    MIN_SAMPLES,
    LengthPredictor,
    parse_known_length,
    prompt_bin,
    spearman,
)
from batchgen.jobs.prompting.prompts import RowError
from batchgen.jobs.rows.planned_row import LengthPrediction

MAX_NEW = 256
KEY = {"model": "m", "template": None}


def synthetic_rows(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens): output grows with the prompt (a summary of a longer text is
    longer), with heavy-ish multiplicative noise, capped at MAX_NEW like a real job."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = int(math.exp(rng.uniform(math.log(8), math.log(4000))))
        output = int((12 + prompt / 20) * math.exp(rng.gauss(0, 0.25)))
        rows.append((prompt, max(1, min(MAX_NEW, output))))
    return rows


def mae(predictor: LengthPredictor, rows: list[tuple[int, int]]) -> float:
    return sum(abs(predictor.predict(p, MAX_NEW).p50 - o) for p, o in rows) / len(rows)


def test_prior_exact_and_known_lengths():
    predictor = LengthPredictor(KEY)
    assert predictor.predict(100, MAX_NEW) == LengthPrediction(MAX_NEW // 2, MAX_NEW, "prior")
    assert predictor.predict(100, 1) == LengthPrediction(1, 1, "prior")  # never below 1 or above the cap
    assert predictor.predict(100, MAX_NEW, known=40) == LengthPrediction(40, 40, "exact")
    assert predictor.predict(100, MAX_NEW, known=0) == LengthPrediction(1, 1, "exact")
    assert predictor.predict(100, 30, known=400) == LengthPrediction(30, 30, "exact")
    eos_free = LengthPredictor(KEY, ignore_eos=True)
    assert eos_free.predict(100, 77) == LengthPrediction(77, 77, "exact")


def test_bins_fall_back_to_the_job_then_to_the_prior():
    predictor = LengthPredictor(KEY)
    for i in range(MIN_SAMPLES - 1):
        predictor.observe(10, 20 + i)
    assert predictor.predict(10, MAX_NEW).source == "prior"
    predictor.observe(10, 30)
    at_10 = predictor.predict(10, MAX_NEW)
    assert at_10.source == "bin" and 20 <= at_10.p50 <= at_10.p90 <= 30
    far = predictor.predict(3000, MAX_NEW)  # no row of that length yet: the job's distribution
    assert far.source == "global" and (far.p50, far.p90) == (at_10.p50, at_10.p90)
    assert predictor.predict(3000, 22).p90 == 22  # clamped to the row's own cap
    assert prompt_bin(1) == 0 and prompt_bin(4) == prompt_bin(5) == 4 and prompt_bin(6) == 5


def test_error_falls_as_rows_complete():
    """Online, as in a job: predict each row, then learn its actual length. The error of the
    predictions made late is far below those made early, and below what the prior scores."""
    held_out = synthetic_rows(300, seed=1)
    predictor = LengthPredictor(KEY)
    checkpoints = {}
    for i, (prompt, output) in enumerate(synthetic_rows(3000, seed=2)):
        if i in (0, 30, 300, 3000 - 1):
            checkpoints[i] = mae(predictor, held_out)
        predictor.observe(prompt, output, predictor.predict(prompt, MAX_NEW))
    assert checkpoints[0] > checkpoints[30] > checkpoints[300] >= checkpoints[2999] * 0.9, checkpoints
    assert checkpoints[2999] < 0.25 * checkpoints[0], checkpoints
    # the online error report agrees: rank correlation and MAE over every prediction made
    error = predictor.error()
    assert error.num_rows == 3000 and error.mae < checkpoints[0]
    assert error.spearman > 0.8, error
    first = LengthPredictor(KEY)
    for prompt, output in synthetic_rows(100, seed=2):
        first.observe(prompt, output, first.predict(prompt, MAX_NEW))
    assert first.error().mae > error.mae  # the first 100 rows were predicted worse than all 3000


def test_memory_is_bounded():
    predictor = LengthPredictor(KEY)
    for prompt, output in synthetic_rows(20_000, seed=3):
        predictor.observe(prompt, output, LengthPrediction(1, 1, "prior"))
    assert predictor.num_learned_rows == 20_000
    assert len(predictor.overall.values) == GLOBAL_SAMPLES
    assert all(len(r.values) <= BIN_SAMPLES for r in predictor.bins.values())
    assert len(predictor.bins) <= 2 * math.log2(4000) + 1


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.8944, abs=1e-4)  # average ranks for ties
    assert spearman([5, 5, 5], [1, 2, 3]) is None
    assert LengthPredictor(KEY).error().spearman is None and LengthPredictor(KEY).error().mae is None


def test_saved_state_is_reused_only_under_the_same_key(tmp_path, caplog):
    predictor = LengthPredictor(KEY)
    for prompt, output in synthetic_rows(500, seed=4):
        predictor.observe(prompt, output)
    assert predictor.save(tmp_path)
    assert predictor.num_observed_since_save == 0
    assert [p.name for p in tmp_path.iterdir()] == [LENGTH_MODEL_FILE]  # no temp file left
    again = LengthPredictor.load(tmp_path, dict(KEY))
    assert again.num_learned_rows == 500
    for prompt in (10, 100, 1000):
        assert again.predict(prompt, MAX_NEW) == predictor.predict(prompt, MAX_NEW)
    other = LengthPredictor.load(tmp_path, {**KEY, "template": "Summarize: {text}"})
    assert other.num_learned_rows == 0 and other.predict(100, MAX_NEW).source == "prior"
    assert LengthPredictor.load(tmp_path / "missing", KEY).num_learned_rows == 0
    (tmp_path / LENGTH_MODEL_FILE).write_text("{not json")
    assert LengthPredictor.load(tmp_path, KEY).num_learned_rows == 0
    (tmp_path / LENGTH_MODEL_FILE).write_text(json.dumps({**predictor.to_json(), "bins": {"x": 1}}))
    assert LengthPredictor.load(tmp_path, KEY).num_learned_rows == 0
    assert "malformed" in caplog.text


def test_a_failed_save_is_a_warning(tmp_path, caplog, monkeypatch):
    """The file only speeds up planning: a full disk is left to the next commit to report."""
    predictor = LengthPredictor(KEY)
    predictor.observe(10, 10)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(length.os, "replace", full)
    assert predictor.save(tmp_path) is False
    assert "could not save" in caplog.text and predictor.num_observed_since_save == 1
    assert list(tmp_path.iterdir()) == []  # the temp file is gone too


def test_parse_known_length():
    assert parse_known_length(None, "n") is None
    assert parse_known_length(12, "n") == 12 and parse_known_length(12.0, "n") == 12
    assert parse_known_length(0, "n") == 0
    for bad in (-1, 1.5, "12", True, float("nan")):
        with pytest.raises(RowError, match="column 'n' must hold a whole number"):
            parse_known_length(bad, "n")
