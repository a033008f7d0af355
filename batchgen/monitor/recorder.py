"""The job's metrics while it runs: per-second records in memory, flushed by a background thread.

The job's thread only folds events into the current second's accumulators (an engine step, a
finished row, a commit: a few additions under an uncontended lock). Every `every_s` seconds the
`batchgen-metrics` thread takes the seconds that have ended, appends them to `_metrics/` as new
segments (batchgen.monitor.store), adds them to the exported counters and rewrites the Prometheus
textfile; the HTTP endpoint reads the same figures when scraped. Nothing here can stop the job:
a failed flush is logged and the records are dropped.

Gauges (running sequences, KV blocks, tokens/s, ETA) are live; counters are what has been
flushed (batchgen.monitor.totals explains why). The ETA is the job's WorkMeter's (batchgen.monitor.eta),
the same figure the progress display shows.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchgen.engine.metrics import StepStats
from batchgen.monitor.eta import RATE_WINDOW_S, WorkMeter
from batchgen.monitor.records import CommitSecond, RowsSecond, StepSecond
from batchgen.monitor.store import SegmentStore, metrics_dir
from batchgen.monitor.totals import Totals

log = logging.getLogger("batchgen")


@dataclass(slots=True)
class Snapshot:
    """What the exporters show at one moment."""

    totals: Totals
    time_s: float
    run_started_s: float
    input_rows: int | None
    output_rows: int
    output_rows_error: int
    last_commit_s: float | None
    num_running: int | None = None
    num_waiting: int | None = None
    num_kv_blocks_used: int | None = None
    num_kv_blocks_total: int | None = None
    tokens_per_s: float | None = None
    input_tokens_per_s: float | None = None
    eta_seconds: float | None = None


class MetricsRecorder:
    def __init__(self, out_dir: str | Path, *, run_id: str, write_files: bool, every_s: float,
                 context: Callable[[], tuple[str | None, int | None]],
                 meter: WorkMeter | None = None, input_rows: int | None = None,
                 output_rows: int = 0, output_rows_error: int = 0, last_commit_s: float | None = None):
        self.run_id = run_id
        self.every_s = every_s
        self.context = context  # (engine mode, planning window being fed) when a second begins
        self.meter = meter  # the ETA: None without one
        self.input_rows = input_rows
        self.output_rows = output_rows
        self.output_rows_error = output_rows_error
        self.last_commit_s = last_commit_s
        self.run_started_s = time.time()
        directory = metrics_dir(out_dir)
        self.store = SegmentStore(directory) if write_files else None
        self.totals = Totals.from_dir(directory) if write_files else Totals()  # flushed: what counters show
        self.exporters: list[Callable[[], None]] = []  # run after each flush (the textfile writer)
        self._lock = threading.Lock()  # the job thread's accumulators against the flusher
        self._flush_lock = threading.Lock()  # the flusher thread against the final flush
        self._rng = random.Random(0)
        self._steps: StepSecond | None = None
        self._rows: dict[tuple[int | None, str | None], RowsSecond] = {}
        self._rows_time_s: int | None = None
        self._commit: CommitSecond | None = None
        self._pending: dict[str, list[dict]] = {"steps": [], "rows": [], "commits": []}
        self._uncommitted = [0, 0, 0]  # rows, error rows, tokens finished since the last commit
        # (second, sampled tokens, prompt tokens computed)
        self._recent: collections.deque[tuple[int, int, int]] = collections.deque()
        self._last_step: StepStats | None = None
        self._first_step_s: int | None = None  # the second of this run's first step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the job's thread ------------------------------------------------------------------
    def on_step(self, stats: StepStats) -> None:
        now = int(time.time())
        with self._lock:
            cur = self._steps
            if cur is None or cur.time_s != now:
                if cur is not None:
                    self._close_steps(cur)
                mode, window = self.context()
                if self._first_step_s is None:
                    self._first_step_s = now
                cur = self._steps = StepSecond(now, mode, window)
            cur.add(stats)
            self._last_step = stats

    def on_row(self, *, window: int | None, mode: str | None, num_prompt_tokens: int, num_generated_tokens: int,
               predicted_tokens: int | None, error: bool, num_shareable_prefix_tokens: int = 0,
               num_prefix_hit_prompt_tokens: int = 0, from_duplicate: bool = False) -> None:
        """A row finished; the last three as batchgen.jobs.planning.duplicates.reuse_counts gives them."""
        now = int(time.time())
        with self._lock:
            if self._rows_time_s != now:
                self._close_rows()
                self._rows_time_s = now
            acc = self._rows.get((window, mode))
            if acc is None:
                acc = self._rows[(window, mode)] = RowsSecond(now, window, mode)
            acc.add(num_prompt_tokens=num_prompt_tokens, num_generated_tokens=num_generated_tokens,
                    predicted_tokens=predicted_tokens, error=error, rng=self._rng,
                    num_shareable_prefix_tokens=num_shareable_prefix_tokens,
                    num_prefix_hit_prompt_tokens=num_prefix_hit_prompt_tokens, from_duplicate=from_duplicate)
            u = self._uncommitted
            u[0] += 1
            u[1] += int(error)
            u[2] += num_generated_tokens

    def on_commit(self, *, seconds: float, output_rows: int, output_rows_error: int) -> None:
        """After a commit that wrote rows (the ones finished since the previous commit)."""
        now = time.time()
        with self._lock:
            cur = self._commit
            if cur is None or cur.time_s != int(now):
                if cur is not None:
                    self._pending["commits"].append(cur.record(self.run_id))
                cur = self._commit = CommitSecond(int(now))
            rows, errors, tokens = self._uncommitted
            self._uncommitted = [0, 0, 0]
            cur.num_commits += 1
            cur.num_rows += rows
            cur.num_rows_error += errors
            cur.num_generated_tokens += tokens
            cur.commit_seconds += seconds
            cur.output_rows = self.output_rows = output_rows
            cur.output_rows_error = self.output_rows_error = output_rows_error
            cur.run_seconds = now - self.run_started_s
            self.last_commit_s = now

    def _close_steps(self, cur: StepSecond) -> None:
        recent = self._recent
        recent.append((cur.time_s, cur.num_sampled_tokens, cur.num_prompt_tokens))
        while recent and recent[0][0] <= cur.time_s - RATE_WINDOW_S:
            recent.popleft()
        self._pending["steps"].append(cur.record(self.run_id, self._eta()))

    def _close_rows(self) -> None:
        self._pending["rows"].extend(acc.record(self.run_id) for acc in self._rows.values())
        self._rows.clear()

    def _rate(self, now_s: float, open_tokens: int = 0, *, column: int = 1) -> float | None:
        """Tokens/s over the last minute (or since the first step, if later): the seconds that ended,
        plus `open_tokens` of the second in progress. Column 1: sampled tokens; 2: prompt tokens."""
        if self._first_step_s is None:
            return None
        since = max(self._first_step_s, now_s - RATE_WINDOW_S)
        span = now_s - since
        if span <= 0:
            return None
        return (open_tokens + sum(r[column] for r in self._recent if r[0] + 1 > since)) / span

    def _eta(self) -> float | None:
        eta = None if self.meter is None else self.meter.estimate().eta_s
        return None if eta is None else round(eta, 1)

    # ---- the flusher -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchgen-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self, *, final: bool = False) -> None:
        with self._flush_lock:
            now = time.time()
            with self._lock:
                cur = self._steps
                if cur is not None and (final or cur.time_s < int(now)):
                    self._close_steps(cur)
                    self._steps = None
                if self._rows_time_s is not None and (final or self._rows_time_s < int(now)):
                    self._close_rows()
                    self._rows_time_s = None
                if self._commit is not None and (final or self._commit.time_s < int(now)):
                    self._pending["commits"].append(self._commit.record(self.run_id))
                    self._commit = None
                pending, self._pending = self._pending, {"steps": [], "rows": [], "commits": []}
            for kind, records in pending.items():
                if self.store is not None and records:
                    try:
                        self.store.append(kind, records)
                    except Exception as e:  # never the job's failure
                        log.warning("could not write %d %s metrics records: %s", len(records), kind, e)
                with self._lock:
                    self.totals.add_records(kind, records)
            for export in self.exporters:
                try:
                    export()
                except Exception as e:
                    log.warning("metrics export failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush(final=True)

    def snapshot(self) -> Snapshot:
        now = time.time()
        with self._lock:
            s = self._last_step
            cur = self._steps
            open_tokens = cur.num_sampled_tokens if cur is not None else 0
            open_prompt = cur.num_prompt_tokens if cur is not None else 0
            snap = Snapshot(self.totals.copy(), now, self.run_started_s, self.input_rows, self.output_rows,
                            self.output_rows_error, self.last_commit_s, tokens_per_s=self._rate(now, open_tokens),
                            input_tokens_per_s=self._rate(now, open_prompt, column=2))
        snap.eta_seconds = self._eta()
        if s is not None:
            snap.num_running, snap.num_waiting = s.num_running, s.num_waiting
            snap.num_kv_blocks_used = s.num_kv_blocks_used
            snap.num_kv_blocks_total = s.num_kv_blocks_used + s.num_kv_blocks_free
        return snap
