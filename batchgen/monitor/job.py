"""One run's monitoring, as the job's config asks for it: the recorder and its Prometheus exports.

`batchgen run` builds it once its output directory is locked and started, feeds it engine steps
(a listener on every engine), finished rows and commits, and closes it last, which flushes the
final seconds. `--overwrite` starts the job over, so its metrics start over too.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from batchgen.config.job import JobConfig
from batchgen.errors import ConfigError
from batchgen.monitor.eta import WorkMeter
from batchgen.monitor.prometheus import PrometheusExport
from batchgen.monitor.recorder import MetricsRecorder
from batchgen.monitor.store import metrics_dir


class JobMonitor:
    def __init__(self, recorder: MetricsRecorder, export: PrometheusExport | None):
        self.recorder = recorder
        self.export = export

    @classmethod
    def open(cls, config: JobConfig, out_dir: Path, *, context: Callable[[], tuple[str | None, int | None]],
             meter: WorkMeter | None, input_rows: int | None, output_rows: int,
             output_rows_error: int, last_commit_s: float | None) -> JobMonitor | None:
        """None when the config asks for no metrics at all (--no-metrics, no textfile, no port)."""
        wants_prometheus = bool(config.metrics_textfile) or config.metrics_port is not None
        if not config.metrics and not wants_prometheus:
            return None
        if config.overwrite:
            shutil.rmtree(metrics_dir(out_dir), ignore_errors=True)
        # unique even for two runs in one process within a second (tests, notebooks)
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        recorder = MetricsRecorder(out_dir, run_id=run_id, write_files=config.metrics, every_s=config.metrics_every_s,
                                   context=context, meter=meter, input_rows=input_rows, output_rows=output_rows,
                                   output_rows_error=output_rows_error, last_commit_s=last_commit_s)
        export = None
        if wants_prometheus:
            export = PrometheusExport(recorder, textfile=config.metrics_textfile, port=config.metrics_port,
                                      host=config.metrics_host)
        monitor = cls(recorder, export)
        if export is not None and export.textfile is not None:
            try:
                export.write_textfile()  # present from the start: a collector never finds it missing mid-job
            except OSError as e:
                export.close()
                raise ConfigError(f"--metrics-textfile: cannot write {export.textfile}: {e.strerror or e}") from None
        recorder.start()
        return monitor

    def close(self) -> None:
        try:
            self.recorder.close()
        finally:
            if self.export is not None:
                self.export.close()
