"""Does the pipeline scale with rows? Peak RSS, rows/s, resume start and `status` time at 10k-1M rows.

    OMP_NUM_THREADS=1 python -m benchmarks.scale.scale_rows --rows 10000 100000 1000000
    OMP_NUM_THREADS=1 python -m benchmarks.scale.scale_rows --rows 10000 100000 --id-column

A tiny random Llama (tests/tiny.py) and 1-4 new tokens per row (--max-new-tokens-column,
--ignore-eos), so the pipeline (reading, prompts, planning, scheduling, output rows, commits,
the manifest), not the model, is what is measured. Each size runs `python -m batchgen run ...
--commit-every 1000` in a fresh process into a fresh directory:

- rows/s: rows / the job's own wall seconds (`_summary.json`: streaming and commits, model
  loading excluded); peak RSS: the process's ru_maxrss, written at exit; other_cores: the mean
  number of cores other processes kept busy meanwhile (benchmarks/sysload.py).
- the largest size is also SIGKILLed half way (once half its rows are committed) and resumed:
  resume start = seconds from the resumed run's "resuming" log line (model loaded, engine built,
  manifest read) to its first "window" line (the first row handed to the engine, after every
  committed row was skipped).
- status: `python -m batchgen status --output DIR --json` on the killed directory, wall seconds
  of the whole command (interpreter start included), and job_status() alone in this process.

Each size but the largest runs --repeat times (median rows/s, largest peak RSS): a 10k-row job
lasts a few seconds, so one run of it swings with the machine. second_half_rows_per_s is the rate
over each job's second half, from its progress lines (start-up left out).

Targets: RSS at 1M within +15% of 10k, rows/s at 1M within 15% of 10k, resume start
under 5 s, status under 2 s. Figures go to stdout as one JSON object (and --json FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.sysload import measure

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "BATCHGEN_LOG_LEVEL": "INFO"}
# runs the CLI in-process and writes ru_maxrss (KiB on Linux) when it exits, whatever the exit code
# with BATCHGEN_RSS_TRACE set, it also traces its memory over time into that file (benchmarks/scale/rss_trace.py)
CHILD = ("import atexit, os, resource, sys\n"
         "out = sys.argv.pop(1)\n"
         "atexit.register(lambda: open(out, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))\n"
         "if os.environ.get('BATCHGEN_RSS_TRACE'):\n"
         "    from benchmarks.scale.rss_trace import start\n"
         "    start(os.environ['BATCHGEN_RSS_TRACE'], sys.argv[sys.argv.index('--output') + 1])\n"
         "from batchgen.cli import main\n"
         "sys.argv[0] = 'batchgen'\n"
         "main()\n")
# what changes how the process' allocators keep memory: recorded with the figures
ALLOCATOR_ENV = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "ARROW_DEFAULT_MEMORY_POOL",
                 "PYTHONMALLOC")
TRACE = False  # --trace-rss: each job writes DIRECTORY/NAME.trace.jsonl
_STAMP_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def make_model(directory: Path) -> Path:
    from tests.tiny import save_tiny_model_dir

    path = directory / "tiny-llama"
    save_tiny_model_dir(path)
    return path


def make_input(path: Path, num_rows: int, id_column: bool) -> Path:
    columns = {"text": [f"row {i} says hello" for i in range(num_rows)],
               "n": [1 + i % 4 for i in range(num_rows)]}
    if id_column:
        columns["doc_id"] = list(range(num_rows))
    pq.write_table(pa.table(columns), path, row_group_size=65536)
    return path


def job_argv(model: Path, src: Path, out: Path, id_column: bool) -> list[str]:
    argv = ["run", "--input", str(src), "--output", str(out), "--model", str(model), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "4", "--max-new-tokens-column", "n", "--ignore-eos",
            "--kv-cache-memory", "64MiB", "--commit-every", "1000", "--rows-per-part", "1000",
            "--commit-every-seconds", "0", "--quiet"]
    return argv + (["--id-column", "doc_id"] if id_column else [])


def start(argv: list[str], rss_file: Path, log_file: Path) -> subprocess.Popen:
    log = open(log_file, "w")  # noqa: SIM115 - closed by the caller through proc.stderr
    env = {**os.environ, **ENV}
    if TRACE:
        env["BATCHGEN_RSS_TRACE"] = str(log_file.with_suffix(".trace.jsonl"))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(rss_file), *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=log)


def run_job(argv: list[str], directory: Path, name: str) -> dict:
    rss_file, log_file = directory / f"{name}.rss", directory / f"{name}.log"
    t0 = time.monotonic()
    with measure() as load:  # a busy neighbour on a shared machine slows every step: record it
        proc = start(argv, rss_file, log_file)
        proc.wait()
    wall = time.monotonic() - t0
    assert proc.returncode == 0, log_file.read_text()[-2000:]
    out = Path(argv[argv.index("--output") + 1])
    summary = json.loads((out / "_summary.json").read_text())
    return {"rows": summary["num_rows"], "job_s": round(summary["wall_seconds"], 2), "process_s": round(wall, 2),
            "rows_per_s": round(summary["num_rows"] / summary["wall_seconds"], 1),
            "peak_rss_mib": round(int(rss_file.read_text()) / 1024, 1),
            "other_cores": None if load.other_cores is None else round(load.other_cores, 2), "log": str(log_file)}


def kill_half_way(argv: list[str], directory: Path, num_rows: int) -> int:
    """Start the job, SIGKILL it once about half its rows are committed; returns the rows committed."""
    out = Path(argv[argv.index("--output") + 1])
    proc = start(argv, directory / "killed.rss", directory / "killed.log")
    while proc.poll() is None:
        if _count_committed(out) >= num_rows // 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.5)
    proc.wait()
    return _count_committed(out)


def _count_committed(out: Path) -> int:
    from batchgen.jobs.commands.status import job_status

    try:
        status = job_status(out)
        return status["done"] + status["errored"]
    except Exception:  # not started yet, or an entry replaced under us
        return 0


def _stamp(line: str) -> float | None:
    m = _STAMP_RE.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def resume_start_s(log_file: Path) -> float:
    resumed = first_window = None
    for line in log_file.read_text().splitlines():
        if resumed is None and "resuming" in line:
            resumed = _stamp(line)
        elif resumed is not None and re.search(r" window \d+ \(", line) and first_window is None:
            first_window = _stamp(line)
    assert resumed is not None and first_window is not None, log_file
    return round(first_window - resumed, 3)


def status_times(out: Path) -> dict:
    from batchgen.jobs.commands.status import job_status

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "batchgen", "status", "--output", str(out), "--json"],
                          env={**os.environ, **ENV}, capture_output=True, text=True)
    cli_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    t0 = time.monotonic()
    status = job_status(out)
    return {"status_cli_s": round(cli_s, 3), "status_in_process_s": round(time.monotonic() - t0, 3),
            "status_parts": status["num_parts"], "manifest_entries_on_disk": len(list((out / "_manifest").iterdir()))}


_PROGRESS_RE = re.compile(r" rows (\d+)/(\d+) ")


def second_half_rows_per_s(log_file: Path) -> float | None:
    """Rows/s over the job's second half, from its progress lines: what the rate is once the
    manifest holds half the rows, apart from start-up (which weighs on a short job's mean)."""
    points = [(t, int(m.group(1))) for line in log_file.read_text().splitlines()
              if (m := _PROGRESS_RE.search(line)) and (t := _stamp(line)) is not None]
    if len(points) < 3:
        return None
    half = points[-1][1] / 2
    t0, n0 = next(p for p in points if p[1] >= half)
    t1, n1 = points[-1]
    return round((n1 - n0) / (t1 - t0), 1) if t1 > t0 else None


def repeated(runs: list[dict]) -> dict:
    """One size run several times: the median run's figures, every run's rows/s, the largest peak."""
    ordered = sorted(runs, key=lambda r: r["rows_per_s"])
    out = dict(ordered[len(ordered) // 2])
    out["rows_per_s_runs"] = [r["rows_per_s"] for r in runs]
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--id-column", action="store_true", help="ids from a column instead of derived")
    parser.add_argument("--no-kill", action="store_true", help="skip the kill and resume of the largest size")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each size but the largest (median rows/s): a 10k job lasts seconds")
    parser.add_argument("--keep-logs", type=Path, help="copy every job's log into this directory")
    parser.add_argument("--trace-rss", action="store_true",
                        help="trace each job's memory every 0.2 s into NAME.trace.jsonl beside its log "
                             "(benchmarks/scale/rss_trace.py; --keep-logs keeps them)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global TRACE
    TRACE = args.trace_rss
    results: dict = {"id_column": args.id_column, "sizes": {},
                     "allocator_env": {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ}}
    with tempfile.TemporaryDirectory(prefix="batchgen-scale-") as tmp:
        tmp = Path(tmp)
        model = make_model(tmp)
        for num_rows in sorted(args.rows):
            src = make_input(tmp / f"in-{num_rows}.parquet", num_rows, args.id_column)
            runs = []
            for k in range(1 if num_rows == max(args.rows) else max(1, args.repeat)):
                out = tmp / f"out-{num_rows}-{k}"
                runs.append(run_job(job_argv(model, src, out, args.id_column), tmp, f"run-{num_rows}-{k}"))
                runs[-1]["second_half_rows_per_s"] = second_half_rows_per_s(Path(runs[-1]["log"]))
                if num_rows != max(args.rows):
                    shutil.rmtree(out)
            figures = repeated(runs)
            results["sizes"][num_rows] = figures
            print(json.dumps({num_rows: figures}), flush=True)
        if not args.no_kill:
            num_rows = max(args.rows)
            src = tmp / f"in-{num_rows}.parquet"
            argv = job_argv(model, src, tmp / "killed", args.id_column)
            committed = kill_half_way(argv, tmp, num_rows)
            status = status_times(tmp / "killed")
            resumed = run_job(argv, tmp, "resumed")
            results["kill"] = {"rows": num_rows, "committed_at_kill": committed, **status,
                               "resume_start_s": resume_start_s(Path(resumed["log"])), "resumed": resumed}
            print(json.dumps({"kill": results["kill"]}), flush=True)
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in [*tmp.glob("*.log"), *tmp.glob("*.trace.jsonl")]:
                shutil.copy(log, args.keep_logs / log.name)
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
