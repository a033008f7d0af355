"""CommitSchedule: when a run commits (rows, seconds), and the commit as one uncut section.

The executors' end-to-end behaviour (kills, resumes, metrics) is covered by test_kill.py,
test_signals.py, test_job_metrics.py and tests/ray; these pin the cadence itself, fast.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from batchgen.jobs.durability import commit_schedule
from batchgen.jobs.durability.commit_schedule import CommitSchedule
from batchgen.jobs.durability.signals import Interrupt, SignalGuard


class FakeCommitter:
    """The Committer's surface the schedule uses: add, len, commit, manifest.state."""

    def __init__(self, guard: SignalGuard, *, signal_on_commit: bool = False):
        self.guard = guard
        self.signal_on_commit = signal_on_commit
        self.buffer: list = []
        self.commits: list[list] = []
        self.manifest = SimpleNamespace(state=SimpleNamespace(num_committed_rows=0, error_ids={}))

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, out, path, row) -> None:
        self.buffer.append((out, path, row))

    def commit(self) -> None:
        if self.signal_on_commit:
            self.guard.signum = signal.SIGTERM  # as the handler records a signal mid-commit
        if self.buffer:
            self.commits.append(self.buffer)
            self.manifest.state.num_committed_rows += len(self.buffer)
            self.buffer = []


class FakeRecorder:
    def __init__(self):
        self.commits: list[dict] = []

    def on_commit(self, **kw) -> None:
        self.commits.append(kw)


def config(**kw):
    return SimpleNamespace(**{**dict(commit_every_rows=None, rows_per_part=4, commit_every_s=None), **kw})


def schedule(cfg, **kw):
    guard = SignalGuard(grace_s=None)
    return CommitSchedule(FakeCommitter(guard, **kw), guard, cfg)


def test_commits_every_n_rows_and_defaults_to_rows_per_part():
    s = schedule(config(commit_every_rows=3))
    for i in range(7):
        s.add({"id": i}, "a.parquet", i)
    assert [len(c) for c in s.committer.commits] == [3, 3] and len(s) == 1
    s = schedule(config(rows_per_part=2))
    for i in range(5):
        s.add({"id": i}, "a.parquet", i)
    assert [len(c) for c in s.committer.commits] == [2, 2] and len(s) == 1


def test_commits_when_the_seconds_passed(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(commit_schedule.time, "monotonic", lambda: now[0])
    s = schedule(config(commit_every_rows=1000, commit_every_s=10))
    s.add({"id": 0}, "a.parquet", 0)
    now[0] = 109.9
    s.add({"id": 1}, "a.parquet", 1)
    assert not s.committer.commits
    now[0] = 110.0
    s.add({"id": 2}, "a.parquet", 2)
    assert [len(c) for c in s.committer.commits] == [3]
    now[0] = 115.0  # the clock restarts at each commit
    s.add({"id": 3}, "a.parquet", 3)
    assert len(s.committer.commits) == 1
    off = schedule(config(commit_every_rows=1000, commit_every_s=0))  # 0: no time-based commits
    now[0] = 1e9
    off.add({"id": 0}, "a.parquet", 0)
    assert off.every_s is None and not off.committer.commits


def test_commit_saves_and_records_inside_one_section_a_signal_does_not_cut():
    s = schedule(config(), signal_on_commit=True)
    depths = []
    s.save_with_commit = lambda: depths.append(s.guard._depth)
    recorder = FakeRecorder()
    s.monitor = SimpleNamespace(recorder=recorder)
    s.add({"id": 0}, "a.parquet", 0)
    with pytest.raises(Interrupt):  # the signal raises once the section ends, not inside it
        s.commit()
    assert depths == [1]  # saved inside the critical section, after the rows were committed
    assert len(recorder.commits) == 1
    assert recorder.commits[0]["output_rows"] == 1 and recorder.commits[0]["output_rows_error"] == 0


def test_an_empty_commit_saves_but_records_nothing():
    s = schedule(config())
    saved = []
    s.save_with_commit = lambda: saved.append(True)
    recorder = FakeRecorder()
    s.monitor = SimpleNamespace(recorder=recorder)
    s.commit()
    assert saved == [True] and recorder.commits == []
