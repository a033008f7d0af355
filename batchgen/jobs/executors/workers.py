"""`batchgen run --workers N`: the job as N shard processes on one machine, then `finalize`.

Why: on a CPU, one engine on all cores meets every other thread at a barrier after each op (~600
a decode step), and its cores wait on the slowest. N engines of cores/N threads each, on disjoint
rows, meet nowhere. That pays most where other work shares the cores (docs/performance.md).

Each worker is `batchgen run` with the job's resolved settings and `--num-shards N --shard-index I`,
so it writes `shard-I-of-N/` under --output with the sharded runs' exactly-once commit protocol, and
resumes as they do: run the same command again. Once every worker succeeded, the shard set is
finalized (checked, `_SUCCESS` written) as `batchgen finalize` does. The workers split the KV-cache
memory the job would have had, run with OMP_NUM_THREADS = cores / N (a user's own value wins), are
sent the SIGINT/SIGTERM this process gets (they commit and stop), and are killed if it dies (Linux).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from batchgen.config.job import JobConfig, parse_bytes
from batchgen.errors import BatchgenError, ConfigError, JobInterrupted
from batchgen.runtime.cpuload import num_cpu_cores

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class WorkerFailed(BatchgenError):
    """A worker exited non-zero: the job ends with its code (every worker's line is logged)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def worker_config(config: JobConfig, num_workers: int, index: int) -> JobConfig:
    """The settings worker `index` runs with (validated, so a bad combination fails here once)."""
    if config.num_shards is not None or config.shard_index is not None:
        raise ConfigError("--workers runs the job as shards itself: leave out --num-shards/--shard-index")
    if config.executor != "local":
        raise ConfigError(f"--workers runs local engine processes; with --executor {config.executor} "
                          "the executor spreads the work")
    if config.device not in ("auto", "cpu"):
        raise ConfigError("--workers is for the CPU (one engine per core group); on a GPU run one job per "
                          "device with --num-shards/--shard-index")
    return config.replace(num_shards=num_workers, shard_index=index, workers=None).validate()  # one shard each


def worker_env(num_workers: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, num_cpu_cores() // num_workers))
    return env


def kv_cache_share(config: JobConfig, num_workers: int) -> int:
    """Each worker's KV-cache bytes: the job's explicit budget, else what one engine would take of
    free memory, split evenly (the workers start together and would each see all of it free)."""
    if config.kv_cache_memory is not None:
        return max(1, parse_bytes(config.kv_cache_memory) // num_workers)
    from batchgen.engine.memory import CPU_KV_CAP_BYTES, CPU_KV_FRACTION, available_cpu_bytes

    return max(1, min(int(available_cpu_bytes() * CPU_KV_FRACTION), CPU_KV_CAP_BYTES) // num_workers)


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def run_workers(config: JobConfig, num_workers: int) -> dict[str, Any]:
    """Run the job as `num_workers` shard processes and finalize; returns finalize's summary."""
    configs = [worker_config(config, num_workers, i) for i in range(num_workers)]
    share = kv_cache_share(config, num_workers)
    env = worker_env(num_workers)
    log.info("%d workers, %s threads each, %d MiB of KV cache each", num_workers, env["OMP_NUM_THREADS"],
             share >> 20)
    with tempfile.TemporaryDirectory(prefix="batchgen-workers-") as tmp:
        procs = []
        for i, worker in enumerate(configs):
            path = Path(tmp) / f"worker-{i}.yaml"
            path.write_text(yaml.safe_dump(dataclasses.asdict(worker.replace(kv_cache_memory=str(share)))))
            cmd = [sys.executable, "-m", "batchgen", "run", "--config", str(path)]
            # stdout is one JSON line at the worker's end (logs go to stderr), so a pipe never fills
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        codes = _wait_forwarding_signals(procs)
    for i, code in enumerate(codes):
        log.info("worker %d/%d exited with %d", i, num_workers, code)
    failed = [(i, code) for i, code in enumerate(codes) if code != 0]
    if failed:
        signals = [code for _, code in failed if code > 128]
        if signals:  # stopped by a signal we forwarded: the job stops as a one-process job does
            raise JobInterrupted(signals[0] - 128)
        i, code = failed[0]
        raise WorkerFailed(f"worker {i} of {num_workers} failed with exit code {code} (its log is above); "
                           "run the same command again to resume", code)
    from batchgen.jobs.sharding.finalize import finalize_output

    result = finalize_output(config.output)
    ran = [_worker_result(p) for p in procs]
    result["rows_run"] = sum(r.get("rows", 0) for r in ran)  # this run's rows, as a one-process run reports
    result["rows_error_run"] = sum(r.get("errors", 0) for r in ran)
    return result


def _worker_result(proc: subprocess.Popen) -> dict[str, Any]:
    """The JSON line a worker's `batchgen run` printed last; {} when it printed none."""
    text = proc.stdout.read().decode(errors="replace") if proc.stdout is not None else ""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _wait_forwarding_signals(procs: list[subprocess.Popen]) -> list[int]:
    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return [p.wait() for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
