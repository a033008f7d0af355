"""The kill -9 harness: a `batchgen run` subprocess SIGKILLed at random moments, checked, resumed.

A tiny random-weight Llama (tests/tiny.py) and an input of `num_rows` prompts with an id column (a
fifth of them copies of another row's prompt) are built in a directory; an uninterrupted greedy run
gives the reference output. `kill_cycle` starts the job as `python -m batchgen run ...` with
--commit-every 8 and SIGKILLs it after a random delay once it holds the output directory's lock (so
the kill lands anywhere from model loading through streaming and committing), up to `kills` times.
After every kill: every part the manifest lists is readable and matches its checksum, no id is
visible twice, and no row committed before the kill is missing after it ("rows lost").

tests/jobs/durability/test_kill.py runs it for a few seeds; benchmarks/soaks/soak_kill.py for 100+.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from tests.jobs.helpers import write_random_texts
from tests.tiny import save_tiny_model_dir

MAX_NEW_TOKENS = 8
COMMIT_EVERY = 8
JOB_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "BATCHGEN_LOG_LEVEL": "WARNING"}


@dataclass(slots=True)
class Fixture:
    model_dir: Path
    src: Path
    num_rows: int
    input: Path | None = None  # what --input names: `src`, or a directory holding it (inputs that change)
    task: str = "generate"  # embed / score / classify: no output tokens (tests/jobs/encoding/test_encode_kill.py)


@dataclass(slots=True)
class SeedResult:
    seed: int
    kills: int = 0
    kill_delays_s: list[float] = field(default_factory=list)
    committed_at_kill: list[int] = field(default_factory=list)  # rows committed when each kill landed
    rows_lost: int = 0  # committed before a kill, gone after it
    rows_duplicated: int = 0  # ids visible more than once, at any check
    rows_missing: int = 0  # input ids absent from the final output
    rows_wrong: int = 0  # final rows that differ from the reference
    rows_stale: int = 0  # final rows generated from an older prompt than the reference's (prompt_hash)
    changes: list[int] = field(default_factory=list)  # rows committed when each input change was made
    rerun_rows: int = 0  # rows processed by a run after success (must be 0)


def make_fixture(directory: Path, num_rows: int = 240) -> Fixture:
    """The tiny model saved as an HF directory and an input of `num_rows` prompts with an id column."""
    model_dir = directory / "tiny-llama"
    save_tiny_model_dir(model_dir)
    src = write_random_texts(directory / "in.parquet", num_rows, seed=0, max_chars=40, alphabet="abcdefgh ijklmnop",
                             row_group_size=64)
    # every fifth row repeats the prompt of a row 3 or 50 before it (--dedup serves it from that row's
    # run): a kill lands between the commits of a prompt's copies too
    table = pq.read_table(src)
    texts = table.column("text").to_pylist()
    for i in range(4, num_rows, 5):
        texts[i] = texts[i - 3] if i % 2 else texts[max(i - 50, 0)]
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts)), src,
                   row_group_size=64)
    return Fixture(model_dir, src, num_rows)


def job_args(fixture: Fixture, out: Path) -> list[str]:
    task = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--kv-cache-memory", "16MiB"] if fixture.task == "generate" \
        else ["--task", fixture.task]
    return ["--input", str(fixture.input or fixture.src), "--output", str(out), "--model", str(fixture.model_dir),
            "--id-column", "id", "--device", "cpu", "--dtype", "float32", *task, "--batch-size", "16",
            "--commit-every", str(COMMIT_EVERY), "--quiet"]


def start_job(fixture: Fixture, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchgen", "run", *job_args(fixture, out)],
                            env={**os.environ, **JOB_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """`proc` does not outlive the block: still running at its end (an assertion failed, a wait
    timed out) it is killed and waited for, so no test leaves a job behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sigkill(proc: subprocess.Popen) -> bool:
    """SIGKILL `proc` unless it has ended, and wait for it (reaped); True if it was killed."""
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return killed


def wait_until_locked(proc: subprocess.Popen, out: Path, timeout_s: float = 120.0) -> bool:
    """True once the job holds the lock (it is past imports); False if it exited first."""
    lock = out / "_batchgen.lock"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if json.loads(lock.read_text()).get("pid") == proc.pid:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    raise TimeoutError(f"job pid {proc.pid} did not start within {timeout_s} s")


def wait_until_a_part(proc: subprocess.Popen, out: Path, timeout_s: float = 300.0) -> bool:
    """True once a committed part is visible; False if the job exited first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if next(out.glob("part-*.parquet"), None) is not None:
            return True
        time.sleep(0.005)
    raise TimeoutError(f"job pid {proc.pid} committed nothing within {timeout_s} s")


def check_committed(out: Path) -> set:
    """Every listed part readable and matching its manifest checksum; visible ids unique.

    Returns the committed ids. Recovery is not run: this is what a reader sees right after a kill.
    """
    from batchgen.io.manifest.manifest import load_manifest
    from batchgen.io.store.local_files import file_digest

    if not (out / "_manifest").is_dir():
        return set()
    state = load_manifest(out)
    state.check_integrity()
    for record in state.parts.values():
        path = out / record.name
        if path.exists():  # a committed part may still sit under its temp name until recovery
            assert file_digest(path) == (record.num_bytes, record.sha256), f"{path} does not match the manifest"
            assert pq.read_table(path).column("id").to_pylist() == record.ids, path
    return state.ok_ids | set(state.error_ids)


def visible_ids(out: Path) -> list:
    if not any(out.glob("part-*.parquet")):
        return []
    return ds.dataset(str(out), format="parquet").to_table(columns=["id"]).column("id").to_pylist()


def read_output(out: Path) -> dict:
    table = ds.dataset(str(out), format="parquet").to_table()
    return {row["id"]: row for row in table.to_pylist()}


def kill_cycle(fixture: Fixture, out: Path, seed: int, *, kills: int, max_delay_s: float,
               between_kills: Callable[[int], None] | None = None, min_delay_s: float = 0.0,
               after_first_part: bool = False) -> SeedResult:
    """Start, SIGKILL after a random delay in [min_delay_s, max_delay_s] from taking the lock, check;
    `kills` times (fewer if the job finishes first). With `after_first_part` the delay counts from
    the first committed part instead, so the kill lands on a half-written output however slowly a
    loaded machine runs the job.

    `between_kills(k)` runs after the k-th kill's check (0-based), before the restart: it may
    change the inputs (tests/jobs/changing_inputs.py)."""
    rng = random.Random(seed)
    result = SeedResult(seed)
    committed: set = set()
    for _ in range(kills):
        with reaped(start_job(fixture, out)) as proc:
            started = wait_until_locked(proc, out)
            if started and after_first_part:
                started = wait_until_a_part(proc, out)
            delay = rng.uniform(min_delay_s, max_delay_s)
            if started:
                time.sleep(delay)
            finished = not sigkill(proc)
        stderr = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        if finished:
            assert proc.returncode == 0, stderr
            break
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, stderr)
        result.kills += 1
        result.kill_delays_s.append(round(delay, 3))
        now = check_committed(out)
        ids = visible_ids(out)
        result.rows_duplicated += len(ids) - len(set(ids))
        result.rows_lost += len(committed - now)
        committed = now
        result.committed_at_kill.append(len(now))
        if between_kills is not None:
            result.changes.append(len(now))
            between_kills(result.kills - 1)
    return result


def check_final(out: Path, fixture: Fixture, reference: dict, result: SeedResult) -> None:
    ids = visible_ids(out)
    result.rows_duplicated += len(ids) - len(set(ids))
    result.rows_missing = len(set(reference) - set(ids))
    final = read_output(out)
    result.rows_wrong = sum(final.get(i) != row for i, row in reference.items())
    result.rows_stale = sum((final.get(i) or {}).get("prompt_hash") != row["prompt_hash"]
                            for i, row in reference.items())
    assert (out / "_SUCCESS").is_file()


def run_to_end_subprocess(fixture: Fixture, out: Path) -> int:
    """Run the job to completion; returns the rows it processed."""
    proc = subprocess.run([sys.executable, "-m", "batchgen", "run", *job_args(fixture, out)],
                          env={**os.environ, **JOB_ENV}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["rows"]


def timed_reference(fixture: Fixture, out: Path) -> tuple[dict, float, float]:
    """An uninterrupted subprocess run: its output, the seconds from taking the lock to writing
    _SUCCESS (model loading, streaming, commits: the window the kills are drawn from), and the
    seconds from the lock to its first part file (temp or published: a commit under way)."""
    proc = start_job(fixture, out)
    wait_until_locked(proc, out)
    t0 = time.monotonic()
    first_part_s = None
    while not (out / "_SUCCESS").exists() and proc.poll() is None:
        if first_part_s is None and (any(out.glob("part-*")) or any(out.glob(".part-*"))):
            first_part_s = time.monotonic() - t0
        time.sleep(0.005)
    window_s = time.monotonic() - t0
    proc.wait()
    assert proc.returncode == 0, proc.stderr.read()
    proc.stderr.close()
    return read_output(out), window_s, window_s if first_part_s is None else first_part_s
