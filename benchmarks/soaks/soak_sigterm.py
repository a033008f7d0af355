"""SIGTERM soak: a job with long rows stopped by SIGTERM at random moments, resumed each time.

    OMP_NUM_THREADS=1 python -m benchmarks.soaks.soak_sigterm --signals 50
    OMP_NUM_THREADS=1 python -m benchmarks.soaks.soak_sigterm --signals 10 --rows 8 --max-new-tokens 192  # a quick look

A tiny random Llama (tests/tiny.py) saved as an HF directory; `--rows` prompts with an id column,
each generating `--max-new-tokens` tokens (ignore-EOS, so every row needs that many steps), batch
`--batch-size`, so rows are in flight most of the time. First an uninterrupted reference run as a
subprocess (`python -m batchgen run`), and the same with --checkpoint-in-flight-every to measure
that mode's overhead (the job's own time writing checkpoints, and the wall time). Then one output
directory: start the job, wait until it has sampled a token (its progress shows in no file, so
a random delay after it holds the lock), send SIGTERM, wait for it to exit (143), restart; after
`--signals` signals, run it to the end and compare with the reference.

Reported: tokens sampled over all attempts / the reference's (each attempt's _summary.json counts
its engine's sampled tokens, in-flight rows included; goal <= 1.05), rows continued, signal->exit
seconds (max against --stop-grace-seconds), and the wall time from a restart's process launch to
its first sampled token (imports and model loading included: what a preempted job waits). On this
shared 2-core machine run it under `nice -n 19` and read the wall times as upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from tests.tiny import save_tiny_model_dir

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "BATCHGEN_LOG_LEVEL": "INFO"}  # INFO: the soak waits for the "window ..." line before signalling


def job_args(model_dir: Path, src: Path, out: Path, args) -> list[str]:
    return [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out),
            "--model", str(model_dir), "--id-column", "id", "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", "--batch-size", str(args.batch_size),
            "--kv-cache-memory", "64MiB", "--commit-every", "1", "--quiet", "--temperature", "0.9", "--seed", "3"]


def summary(out: Path) -> dict:
    path = out / "_summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def output(out: Path) -> dict:
    rows = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    return {r["id"]: (r["generated_text"], r["num_generated_tokens"]) for r in rows}


def run_to_end(cmd: list[str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return time.monotonic() - t0


WINDOW_LINE = re.compile(rb"(^|\s)window \d+ \(")  # the job core's log line as it feeds a window


def wait_generating(proc: subprocess.Popen, timeout_s: float = 300.0) -> bool:
    """True once the job logs its first planning window (generation begins), False if it exits first. Its
    stderr keeps being drained by a thread, so the job never blocks on a full pipe."""
    started = threading.Event()

    def drain():
        for line in proc.stderr:
            if WINDOW_LINE.search(line):
                started.set()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if started.wait(0.01):
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--signals", type=int, default=50)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=float, default=0.25, help="for the overhead run (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay-s", type=float, default=None,
                        help="signal at uniform(0, this) s after generation starts [half the reference job time]")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop signalling after this many seconds of soak (then run to the end)")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="batchgen-sigterm-") as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "tiny-llama"
        save_tiny_model_dir(model_dir)
        src = tmp / "in.parquet"
        texts = ["".join(rng.choice("abcdefgh ijk") for _ in range(rng.randint(5, 40))) for _ in range(args.rows)]
        pq.write_table(pa.table({"id": list(range(args.rows)), "text": texts}), src)

        ref_wall_s = run_to_end(job_args(model_dir, src, tmp / "ref", args))
        ref = summary(tmp / "ref")
        assert ref["num_rows_error"] == 0 and ref["num_sampled_tokens"], (
            "the reference run failed rows: prompt + --max-new-tokens must fit the tiny model's 512 positions")
        periodic = job_args(model_dir, src, tmp / "periodic", args) + [
            "--checkpoint-in-flight-every", str(args.checkpoint_every)]
        periodic_wall_s = run_to_end(periodic)
        per = summary(tmp / "periodic")
        assert output(tmp / "periodic") == output(tmp / "ref")

        out = tmp / "soak"
        cmd = job_args(model_dir, src, out, args)
        sampled = continued = signals = 0
        exit_s, first_token_s = [], []
        # the reference's job time (from its first window to the end, roughly) bounds where a signal
        # can land mid-generation; half of it, so most attempts are stopped, not finished
        stream_s = ref["wall_seconds"]
        soak_started = time.monotonic()
        while signals < args.signals and (args.budget_s is None or time.monotonic() - soak_started < args.budget_s):
            launched = time.time()
            proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            if wait_generating(proc):
                time.sleep(rng.uniform(0.0, args.max_delay_s or stream_s / 2))
            if proc.poll() is None:
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                exit_s.append(time.monotonic() - t0)
            proc.wait()
            s = summary(out)
            sampled += s.get("num_sampled_tokens", 0)
            continued += s.get("num_rows_continued", 0)
            if s.get("num_rows_continued") and s.get("first_token_time"):
                first_token_s.append(s["first_token_time"] - launched)
            if proc.returncode == 0 or (out / "_SUCCESS").exists():
                # finished before its signal, or in the moment after its handlers were restored
                # (-15 then): the job was complete
                break
            assert proc.returncode == 143, proc.returncode
            signals += 1
            (out / "_summary.json").unlink(missing_ok=True)  # the next attempt's, not this one's
            committed = len(output(out)) if any(out.glob("part-*")) else 0
            print(f"signal {signals}: exit in {exit_s[-1]:.2f} s, {committed} rows committed, {sampled} tokens "
                  "sampled so far", flush=True)
        if not (out / "_SUCCESS").exists():
            run_to_end(cmd)
            s = summary(out)
            sampled += s.get("num_sampled_tokens", 0)
            continued += s.get("num_rows_continued", 0)
        same = output(out) == output(tmp / "ref")
        record = {
            "signals": signals, "rows": args.rows, "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "output_equals_uninterrupted": same,
            "tokens_sampled_all_attempts": sampled, "tokens_sampled_uninterrupted": ref["num_sampled_tokens"],
            "ratio": round(sampled / ref["num_sampled_tokens"], 4), "rows_continued": continued,
            "signal_to_exit_s": {"max": round(max(exit_s), 3), "median": round(statistics.median(exit_s), 3)}
            if exit_s else None,
            "launch_to_first_resumed_token_s": {"min": round(min(first_token_s), 3),
                                                "median": round(statistics.median(first_token_s), 3),
                                                "max": round(max(first_token_s), 3)} if first_token_s else None,
            "uninterrupted_wall_s": round(ref_wall_s, 3), "uninterrupted_stream_s": ref["wall_seconds"],
            "periodic_checkpoint": {"every_s": args.checkpoint_every, "wall_s": round(periodic_wall_s, 3),
                                    "stream_s": per["wall_seconds"], "checkpoints": per["num_inflight_checkpoints"],
                                    "seconds_writing": per["inflight_checkpoint_seconds"],
                                    "share_of_stream": round(per["inflight_checkpoint_seconds"]
                                                             / per["wall_seconds"], 5)},
        }
        print(json.dumps(record, indent=1))
        if args.json:
            args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
