"""Typed errors. Each user-facing error carries the exit code the CLI returns for it.

Exit codes (documented in README):
    0  the job finished
    1  unexpected failure (a bug, an engine crash)
    2  usage, config or input error: nothing was generated for it, fix the command or the data
    3  the job finished but more rows failed than --max-error-rate allows
    4  `batchgen finalize`: a shard of the sharded job is missing, still running or not complete;
       run (or resume) it, then finalize again
  130  interrupted by SIGINT (Ctrl-C): finished rows were committed, rerun the command to resume
  143  interrupted by SIGTERM: the same

`batchgen status` exits 0 for every state it reports, "not_started" included (an output no run
has written yet): a sensor polling it before the first run does not fail. It exits 2 only for a
directory that holds something else.

No code is 99, which Airflow's BashOperator reads as "skip the task" (skip_on_exit_code): every
failure above must fail (and retry) an Airflow task, never skip it. tests/test_errors.py checks.
"""

from __future__ import annotations

import signal


class BatchgenError(Exception):
    """Base of every error batchgen raises on purpose."""

    exit_code: int = 1


class UsageError(BatchgenError):
    """The user asked for something impossible: bad flag, bad config value."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file or merged config value is invalid."""


class InputError(UsageError):
    """An input file is missing, unreadable or malformed.

    The message always names the file, and where known the row and the column.
    """

    def __init__(self, message: str, *, path: str | None = None, row: int | None = None,
                 column: str | None = None):
        where = []
        if path is not None:
            where.append(str(path))
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{': '.join([', '.join(where), message]) if where else message}")
        self.path = path
        self.row = row
        self.column = column


class InputsChanged(UsageError):
    """The inputs differ from those the committed rows came from, and their ids cannot tell rows apart."""


class ModelLoadError(UsageError):
    """The model or tokenizer could not be loaded (missing, wrong path, missing optional package)."""


class UnsupportedModelError(UsageError):
    """The model uses a feature the engine does not implement (e.g. sliding-window attention)."""


class OutputError(UsageError):
    """The output directory cannot be used (not writable, holds another job's output, locked)."""


class AlreadyExists(OutputError):
    """An exclusive write found its name taken: another writer got there first (a manifest entry)."""


class UnsupportedOutputError(OutputError):
    """The output is a URL that no object store here can write (ftp://, a bare bucket, gs:// without GCS)."""


class OutputLocked(OutputError):
    """Another live batchgen process holds the output directory's lock."""


class DamagedSnapshot(OutputError):
    """A manifest snapshot's rows file is unreadable or not the file its entry recorded (sha256):
    the load replays the entries before the snapshot instead, where they are all still there."""


class FingerprintMismatch(OutputError):
    """The output directory holds rows committed under a different job config."""


class ShardsMismatch(OutputError):
    """A sharded job's shards do not form one job: other settings, other inputs, a row in two shards."""


class ShardsIncomplete(BatchgenError):
    """`batchgen finalize`: a shard is missing, still running or not complete (exit 4): run or resume it."""

    exit_code = 4


class EngineError(BatchgenError):
    """The engine failed on valid input (an internal failure, not the user's mistake)."""

    exit_code = 1


class ErrorRateExceeded(BatchgenError):
    """More rows failed than the configured maximum error rate."""

    exit_code = 3


class JobInterrupted(BatchgenError):
    """SIGINT or SIGTERM stopped the job after it committed its finished rows (exit 130 / 143)."""

    def __init__(self, signum: int, message: str | None = None):
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        name = signal.Signals(signum).name
        super().__init__(message or f"interrupted by {name}")
