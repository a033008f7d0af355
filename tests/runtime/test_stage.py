"""slow_stage: a slow start-up step logs when it begins, while it runs (the innermost of nested
stages only) and what it took."""

from __future__ import annotations

import logging
import threading

import pytest

from batchgen.runtime.stage import slow_stage

log = logging.getLogger("batchgen.test.stage")


def wait_for_lines(caplog, text: str, count: int) -> None:
    seen = threading.Event()
    for _ in range(500):  # 10 s at most
        if sum(text in r.getMessage() for r in caplog.records) >= count:
            seen.set()
            break
        seen.wait(0.02)
    assert seen.is_set(), [r.getMessage() for r in caplog.records]


def test_a_stage_says_it_began_that_it_still_runs_and_what_it_took(caplog):
    caplog.set_level(logging.INFO, logger="batchgen.test.stage")
    with slow_stage("converting x.gguf", logger=log, every_s=0.02):
        wait_for_lines(caplog, "converting x.gguf: ", 2)  # two heartbeats while it runs
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "converting x.gguf ..."
    assert all(m.endswith(" s so far") for m in messages[1:-1]) and len(messages) >= 4, messages
    assert messages[-1].startswith("converting x.gguf: done in ") and messages[-1].endswith(" s")


def test_nested_stages_tick_the_innermost_only(caplog):
    caplog.set_level(logging.INFO, logger="batchgen.test.stage")
    with slow_stage("loading model m", logger=log, every_s=0.02):
        with slow_stage("converting m.gguf", logger=log, every_s=0.02):
            wait_for_lines(caplog, "converting m.gguf: ", 3)
        messages = [r.getMessage() for r in caplog.records]
        # The outer stage may tick once the inner one is done; never while it runs or before its last line.
        inner_done = next(i for i, m in enumerate(messages) if m.startswith("converting m.gguf: done in "))
        outer_ticks = [m for m in messages[:inner_done + 1] if m.startswith("loading model m: ")]
        assert outer_ticks == [], messages


def test_a_failed_stage_claims_no_time_done(caplog):
    caplog.set_level(logging.DEBUG, logger="batchgen.test.stage")
    with pytest.raises(ValueError), slow_stage("building k.c", logger=log, every_s=60, done_level=logging.DEBUG):
        raise ValueError("compiler failed")
    assert [r.getMessage() for r in caplog.records] == ["building k.c ..."]
