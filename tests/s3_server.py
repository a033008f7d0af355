"""What the object-store output tests share: a real S3 API server on localhost (moto's server mode)
and the helpers that read a job's output from it. A pytest plugin of tests/conftest.py.

`s3_endpoint` starts moto's ThreadedMotoServer on a free port once per session; `s3_out` points the
standard AWS environment variables at it (AWS_ENDPOINT_URL, fake credentials) for one test, creates
a fresh bucket, and returns an output URL inside it. Subprocess jobs inherit the environment.
`quick_lease_settle` cuts the lease's settle wait, for a test module's `pytestmark`.
"""

from __future__ import annotations

import logging
import socket
import sys
import uuid
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import pyarrow as pa

REGION = "us-east-1"
KEY, SECRET = "testing", "testing"


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request in test output
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_out(s3_endpoint, monkeypatch) -> str:
    """s3://<a new bucket>/job, with the AWS environment pointing at the local server."""
    for name, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    bucket = f"bg-{uuid.uuid4().hex[:12]}"
    s3_filesystem(s3_endpoint).create_dir(bucket)
    return f"s3://{bucket}/job"


@pytest.fixture
def quick_lease_settle(monkeypatch):
    """No job in these tests races another within the lease's settle wait: cut it short."""
    from batchgen.io.store import lease

    monkeypatch.setattr(lease, "LEASE_SETTLE_S", 0.05)


def s3_filesystem(endpoint: str):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[1], scheme="http", region=REGION,
                             access_key=KEY, secret_key=SECRET, allow_bucket_creation=True)


def committed_table(url: str) -> pa.Table:
    """The committed output rows: the parts the manifest names, never a plain listing."""
    import pyarrow as pa

    from batchgen.io.manifest.manifest import load_manifest
    from batchgen.io.store.factory import open_store

    store = open_store(url)
    state = load_manifest(store)
    tables = [store.read_table(name) for name in sorted(state.parts)]
    return pa.concat_tables(tables) if tables else pa.table({})


def committed_by_id(*urls: str) -> dict:
    """The committed rows of every output in `urls` (a job's, or each shard's), by id; fails if
    any id is committed twice."""
    import pyarrow as pa

    table = pa.concat_tables([committed_table(url) for url in urls])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id is committed twice"
    return {row["id"]: row for row in table.to_pylist()}


def tiny_run_args(src, out: str, model_dir, *flags: str) -> list[str]:
    """`batchgen run` on the tiny model as tests.jobs.helpers.tiny_job_config sets it up (CPU,
    float32, a 16 MiB KV cache, quiet), in a subprocess; `flags` add the test's own settings."""
    return [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", out, "--model", str(model_dir),
            "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", *flags, "--quiet"]


KILLED_JOB_TTL_S = 4.0  # the killed job's lease: an unexpired lease is never taken over, so keep it short


def kill_once_committed(args: list[str], store, at_least: int) -> bool:
    """Run the `batchgen run` command `args` and SIGKILL it once `store` holds `at_least` committed
    rows (or let it end); True if it was killed. Either way it must have exited cleanly or by the kill.
    After a kill this waits out the job's lease (KILLED_JOB_TTL_S), as a retry would."""
    import os
    import signal
    import subprocess
    import time

    from batchgen.io.manifest.manifest import load_manifest
    from batchgen.io.store.lease import TTL_ENV, read_lease
    from tests.jobs.kill_harness import JOB_ENV, reaped, sigkill

    env = {**os.environ, **JOB_ENV, TTL_ENV: str(KILLED_JOB_TTL_S)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with reaped(proc):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if store.is_dir("_manifest") and load_manifest(store).num_committed_rows >= at_least:
                break
            time.sleep(0.3)  # the server shares this process: poll it gently
        killed = sigkill(proc)
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    assert proc.returncode in (0, -signal.SIGKILL), stderr
    lease = read_lease(store) if killed else None
    if lease is not None:
        time.sleep(max(float(lease["expires"]) - time.time(), 0) + 0.1)
    return killed
