"""When a run commits its finished rows, and the commit as one section a signal does not cut.

Both executors (batchgen.jobs.executors.local, batchgen.jobs.executors.ray.driver) hand every finished row to a
CommitSchedule: it buffers the row in the Committer (batchgen.jobs.durability.commit) and commits once
--commit-every rows are buffered (default --rows-per-part) or --commit-every-seconds have passed
since the last commit, checked as each row arrives. A commit writes the parts and the manifest
entry, then whatever the executor saves with it (the local one: the learned output lengths), and
records it in the job's metrics, all inside the guard's critical section. After it, at most once
per few seconds, the C heap's free pages go back to the system (batchgen.runtime.heap): the engine's
evicted kernels leave them behind all job long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchgen.config.job import JobConfig
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.durability.signals import SignalGuard
from batchgen.runtime.heap import HeapTrimmer

if TYPE_CHECKING:
    from batchgen.monitor.job import JobMonitor


class CommitSchedule:
    """A run's committer with its cadence; see the module docstring."""

    def __init__(self, committer: Committer, guard: SignalGuard, config: JobConfig, *,
                 save_with_commit: Callable[[], None] | None = None):
        self.committer = committer
        self.guard = guard
        self.every_rows = config.commit_every_rows or config.rows_per_part
        self.every_s = config.commit_every_s or None  # None or 0: no time-based commits
        self.save_with_commit = save_with_commit  # called inside each commit's critical section, after it
        self.monitor: JobMonitor | None = None  # the run's metrics, once it opened them
        self.last_commit = time.monotonic()
        self.trimmer = HeapTrimmer()

    def __len__(self) -> int:
        return len(self.committer)

    def add(self, out: dict[str, Any] | list[dict[str, Any]], path: str, row: int) -> None:
        """Buffer one finished input row's output (a row, or one per sample; its input file's path and
        row index); commit when due."""
        self.committer.add(out, path, row)
        if self.due():
            self.commit()

    def due(self) -> bool:
        return len(self.committer) >= self.every_rows or (
            self.every_s is not None and time.monotonic() - self.last_commit >= self.every_s)

    def commit(self) -> None:
        """Commit the buffered rows (none: no manifest entry), then save_with_commit, then record the
        commit in the metrics: one section a signal does not cut."""
        num_rows = len(self.committer)
        t0 = time.monotonic()
        with self.guard.critical():
            self.committer.commit()
            if self.save_with_commit is not None:
                self.save_with_commit()
            if self.monitor is not None and num_rows:
                state = self.committer.manifest.state
                self.monitor.recorder.on_commit(seconds=time.monotonic() - t0, output_rows=state.num_committed_rows,
                                                output_rows_error=len(state.error_ids))
        self.trimmer.maybe_trim()
        self.last_commit = time.monotonic()
