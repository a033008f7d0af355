"""`batchgen report`: an HTML page with every figure embedded and the PNGs, for a finished job (with
error rows) and for a job killed mid-run; rendered by headless Chromium where it is installed."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time

import matplotlib.image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from batchgen.monitor.report import error_reasons, render_job_report
from tests.jobs.kill_harness import JOB_ENV, job_args, make_fixture, reaped, sigkill, wait_until_locked

FIGURES = ["tokens_per_s", "batch_kv", "step_times", "lengths", "rows_per_window", "errors"]


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("report-job"), 160)


@pytest.fixture(scope="module")
def finished_job(fixture, tmp_path_factory):
    """A finished job whose input has 7 empty prompts (error rows), in two planning windows."""
    directory = tmp_path_factory.mktemp("finished")
    table = pq.read_table(fixture.src)
    texts = [("" if i % 23 == 0 else t) for i, t in enumerate(table["text"].to_pylist())]
    src = directory / "in.parquet"
    pq.write_table(pa.table({"id": table["id"], "text": texts}), src)
    out = directory / "out"
    run_job(build_config(None, inputs=[str(src)], output=str(out), model=str(fixture.model_dir), id_column="id",
                         device="cpu", dtype="float32", max_new_tokens=16, kv_cache_memory="16MiB", batch_size=16,
                         commit_every_rows=32, window_rows=80, quiet=True, metrics_every_s=0.2))
    return out


def embedded_images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def check_report(files, *, png: bool):
    html = files.html_path.read_text()
    images = embedded_images(html)
    assert len(images) == len(FIGURES)
    assert all(img.startswith(b"\x89PNG") and len(img) > 5000 for img in images)
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org", "")  # self-contained
    if png:
        assert sorted(p.stem for p in files.png_paths) == sorted(FIGURES)
        assert all(p.read_bytes().startswith(b"\x89PNG") for p in files.png_paths)
    return html


def test_report_of_a_finished_job(finished_job, tmp_path):
    files = render_job_report(finished_job, dest=tmp_path / "r", png=True)
    html = check_report(files, png=True)
    assert "complete" in html and "160 of 160 (7 error rows)" in html
    reasons = error_reasons(finished_job, load_manifest(finished_job))
    assert sum(reasons.values()) == 7 and len(reasons) == 1
    assert "is empty" in next(iter(reasons))


def test_report_cli_writes_into_the_output_directory(finished_job):
    proc = subprocess.run([sys.executable, "-m", "batchgen", "report", str(finished_job), "--png"],
                          capture_output=True, text=True, env={**os.environ, **JOB_ENV})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["html"] == str(finished_job / "_report" / "report.html") and len(result["png"]) == len(FIGURES)
    # the report is bookkeeping: a reader of the output still sees only the parts
    import pyarrow.dataset as ds

    assert ds.dataset(str(finished_job), format="parquet").count_rows() == 160


@pytest.mark.soak
def test_report_of_a_job_killed_mid_run(fixture, tmp_path):
    out = tmp_path / "out"
    # a small batch keeps the job running well past its first commit, on a fast machine too
    args = [*job_args(fixture, out), "--max-new-tokens", "48", "--metrics-every-seconds", "0.2", "--batch-size", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", "run", *args], env={**os.environ, **JOB_ENV},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with reaped(proc):
        assert wait_until_locked(proc, out)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list((out / "_metrics").glob("commits-*.parquet"))) >= 1:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before the kill"
        sigkill(proc)
    files = render_job_report(out, dest=tmp_path / "r", png=True)
    html = check_report(files, png=True)
    assert "stopped before the end" in html


def test_missing_directory_is_a_user_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchgen", "report", str(tmp_path / "nope")],
                          capture_output=True, text=True, env={**os.environ, **JOB_ENV})
    assert proc.returncode == 2 and "not a batchgen output directory" in proc.stderr


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed (Debian: chromium)")
def test_chromium_renders_the_report(finished_job, tmp_path):
    files = render_job_report(finished_job, dest=tmp_path / "r")
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1700,1500", f"--screenshot={shot}", files.html_path.as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1500, 1700)
    # the figures drew: far from a blank page (a broken image shows as a small icon on white)
    assert pixels[:, :, :3].std() > 0.1
