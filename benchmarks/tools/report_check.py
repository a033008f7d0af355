"""The report as a person sees it: a real job killed mid-run and resumed, its report rendered by
headless Chromium to a screenshot.

    OMP_NUM_THREADS=1 python -m benchmarks.tools.report_check            # embedded SmolLM2-135M, ~2 minutes

Runs `batchgen run` on examples/docs.parquet (the embedded model, --window-rows 20 so there are
several windows, a few empty prompts appended so there are error rows) with a Prometheus textfile,
SIGKILLs it after --kill-after seconds, resumes it to the end, then writes `batchgen report --png`
and, where Debian's `chromium` is installed, a full-page screenshot of the HTML. Everything goes
to benchmarks/results/report_check/ (gitignored): the output directory, report.html, the PNGs,
screenshot.png and the textfile before and after the resume.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import EXAMPLE_DOCS, RESULTS_DIR

RESULTS = RESULTS_DIR / "report_check"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BATCHGEN_LOG_LEVEL": "WARNING"}


def job(src: Path, out: Path, prom: Path, max_new_tokens: int) -> list[str]:
    return [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--template",
            "Summarize in one sentence:\n\n{text}", "--max-new-tokens", str(max_new_tokens), "--max-prompt-tokens",
            "384", "--window-rows", "20", "--commit-every", "8", "--metrics-every-seconds", "2",
            "--metrics-textfile", str(prom), "--quiet"]


def screenshot(html: Path, shot: Path, width: int, height: int) -> bool:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not installed (Debian: apt-get install chromium): no screenshot")
        return False
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={shot}", html.as_uri()],
                   check=True, capture_output=True, timeout=180)
    print(f"wrote {shot}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-after", type=float, default=40.0, help="seconds after the lock is taken")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    shutil.rmtree(RESULTS, ignore_errors=True)
    RESULTS.mkdir(parents=True)
    docs = pq.read_table(EXAMPLE_DOCS)
    texts = docs["text"].to_pylist() + ["", "   ", None]
    src = RESULTS / "docs-with-bad-rows.parquet"
    pq.write_table(pa.table({"text": texts}), src)
    out, prom = RESULTS / "out", RESULTS / "job.prom"

    proc = subprocess.Popen(job(src, out, prom, args.max_new_tokens), env=ENV)
    while not (out / "_batchgen.lock").exists() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(args.kill_after)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        print(f"killed the job after {args.kill_after} s")
    proc.wait()
    shutil.copy(prom, RESULTS / "job-before-resume.prom")
    subprocess.run(job(src, out, prom, args.max_new_tokens), env=ENV, check=True)
    report = subprocess.run([sys.executable, "-m", "batchgen", "report", str(out), "--png", "--to", str(RESULTS)],
                            env=ENV, check=True, capture_output=True, text=True)
    files = json.loads(report.stdout)
    print(f"wrote {files['html']} and {len(files['png'])} PNGs")
    screenshot(Path(files["html"]), RESULTS / "screenshot.png", 1700, 1900)


if __name__ == "__main__":
    main()
