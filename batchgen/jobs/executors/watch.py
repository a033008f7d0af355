"""What watches a run in this process, generation or an encode task alike: the metrics
(batchgen.monitor: _metrics/, Prometheus) and the progress line, both fed the engine's steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.config.job import JobConfig
from batchgen.io.store.store import LocalStore
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.pipeline.progress import Progress
from batchgen.monitor.eta import WorkMeter
from batchgen.monitor.job import JobMonitor


def watch_run(config: JobConfig, session: OutputSession, scan: InputScan, *, num_rows_done: int,
              context: Callable[[], Any], meter: WorkMeter,
              add_listener: Callable[[Callable], None]) -> tuple[JobMonitor | None, Progress, int]:
    """The run's monitor (None with --no-metrics and no Prometheus), its progress line and its number
    of rows to do: the input's less the `num_rows_done` by earlier runs. `add_listener` hands the
    monitor's recorder the engine's steps; `context` names what runs (the mode, or the task)."""
    state = session.state  # what earlier runs committed: the gauges start there
    monitor_config, metrics_at = config, session.out_dir
    if not isinstance(session.store, LocalStore):
        # the _metrics/ files are appended second by second: local directories only; the
        # Prometheus textfile and port work the same for an object-store output
        monitor_config, metrics_at = dataclasses.replace(config, metrics=False, overwrite=False), Path(".")
    num_rows_to_do = max(scan.num_rows - num_rows_done, 0)
    monitor = JobMonitor.open(
        monitor_config, metrics_at, context=context, meter=meter, input_rows=scan.num_rows,
        output_rows=state.num_committed_rows, output_rows_error=len(state.error_ids),
        last_commit_s=state.last_commit_time)
    if monitor is not None:
        add_listener(monitor.recorder.on_step)
    progress = Progress(num_rows_to_do, quiet=config.quiet, log_every_s=config.log_every_s, meter=meter)
    return monitor, progress, num_rows_to_do
