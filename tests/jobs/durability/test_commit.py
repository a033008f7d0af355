"""A commit that fails leaves no part that a plain listing reads, and `_SUCCESS` vouches for the listing.

An object store has no hidden temps: a part is staged under its final name, so a commit refused
after staging (the lease lost) must delete what it staged; and a part that some other writer
left under a final name (a stalled job that lost the lease) is swept before `_SUCCESS`.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.errors import OutputLocked
from batchgen.io.manifest.manifest import PART_NAME_RE, SUCCESS_FILE, Manifest
from batchgen.io.store import local_files
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_FILE, Lease
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.durability.commit import Committer
from tests.jobs.helpers import tiny_job_config

pytestmark = pytest.mark.usefixtures("quick_lease_settle")

SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string())])


def listed_parts(store) -> set[str]:
    return {name for name in store.list() if PART_NAME_RE.fullmatch(name)}


def test_a_commit_refused_after_staging_leaves_no_part_under_a_final_name(s3_out):
    store = open_store(s3_out)
    lease = Lease(store)
    lease.acquire()
    try:
        manifest = Manifest(store, guard=lease)
        manifest.begin({"k": 1})
        committer = Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=4)
        for i in range(3):
            committer.add({"id": i, "error": None}, "in.parquet", i)
        committer.commit()
        committed = listed_parts(store)
        assert len(committed) == 1
        # another job takes the lease over (this one stalled past its expiry)
        store.write_bytes(LEASE_FILE, json.dumps({"holder": "thief", "pid": 1, "host": "elsewhere",
                                                  "expires": time.time() + 60, "ttl_s": 60}).encode())
        for i in range(3, 6):
            committer.add({"id": i, "error": None}, "in.parquet", i)
        with pytest.raises(OutputLocked):
            committer.commit()
        assert listed_parts(store) == committed  # before: the refused commit's part stayed, read by any listing
    finally:
        lease._stop.set()
        lease._held = False


def test_success_is_written_over_exactly_the_committed_parts(tmp_path, tiny_model_dir, loaded, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(12)), "text": [f"row {i}" for i in range(12)]}), src)
    out = tmp_path / "out"
    stray = out / "part-00077-0badf00d.parquet"

    def stalled_writer_lands(point: str) -> None:  # a job that lost the lease PUTs a part mid-run
        if point == "write" and out.is_dir() and not stray.exists():
            pq.write_table(pa.table({"id": [3], "text": ["a row read twice"]}), stray)

    monkeypatch.setattr(local_files, "_fault_hook", stalled_writer_lands)
    summary = run_job(tiny_job_config(src, out, tiny_model_dir, id_column="id", max_new_tokens=2, batch_size=4,
                                      commit_every_rows=4), loaded=loaded)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert summary.complete and (out / SUCCESS_FILE).exists()
    assert not stray.exists()  # before: _SUCCESS beside a part no entry commits
    ids = ds.dataset(str(out), format="parquet").to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == list(range(12))
