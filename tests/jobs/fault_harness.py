"""Fault-injection soak of the commit protocol: what schedulers do to jobs, on local disk and S3.

One seed, in-process and on the protocol's own functions (no model: rows are made up, each id's
row known in advance), for tests/jobs/test_fault_soak.py (a few seeds) and
benchmarks/fault_soak.py (many):

- two writers on one output: A commits a few batches, then stalls at a random fault point of its
  next commit (staging a part, writing the entry, publishing) past its lease, as SIGSTOP would;
  meanwhile B takes the output over (on S3, once the lease expires; on local disk B is refused,
  the flock being held) and finishes the job, writing `_SUCCESS`; then A resumes and must commit
  nothing more (or, on local disk, it finishes the job itself);
- `status` polled in a thread the whole time: it must never call the manifest damaged;
- then the output is read as a plain listing (`**/*.parquet`, what `_SUCCESS` vouches for) and
  through the manifest, and counted: rows lost, duplicated, "mixed" (a listed part that no entry
  commits, or a committed part that is not there) and "stale" (a row of A committed after it lost
  the lease).

`finalize_race` runs two finalizes and a compact of a sharded job's OpenAI Batch files at once.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from batchgen.errors import OutputError, OutputLocked
from batchgen.io.inputs.openai_batch import ID_COLUMN
from batchgen.io.manifest.manifest import PART_NAME_RE, SUCCESS_FILE, Manifest, load_manifest, write_success
from batchgen.io.store import local_files
from batchgen.io.store.lease import Lease
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.finalize import finalize_output
from batchgen.jobs.commands.status import job_status
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.openai.output import SUCCESS_KEY, write_batch_files

NUM_ROWS = 40
BATCH = 4
TTL_S = 1.0  # A's lease on S3: short, so a stall outlives it within a second
TTL_B_S = 30.0  # B never stalls
SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string()), ("text", pa.string())])
FAULT_POINTS = ("write", "fsync", "rename", "file_write", "file_fsync", "file_rename", "file_fsync_dir")


@dataclass
class SeedResult:
    seed: int
    store: str
    lost: int = 0
    duplicated: int = 0
    mixed: int = 0
    stale: int = 0
    success: bool = False  # _SUCCESS present at the end
    success_true: bool = True  # where present: the listing holds every row once, and only committed parts
    damaged_polls: int = 0
    polls: int = 0
    a_stopped: str = ""  # how the stalled writer ended
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.mixed or self.stale or self.damaged_polls) and \
            self.success and self.success_true


def _claim(store: OutputStore, ttl_s: float = TTL_S):
    return Lease(store, ttl_s=ttl_s) if not isinstance(store, LocalStore) else store.lock()


def _commit_ids(committer: Committer, ids: list[int], tag: str) -> None:
    for start in range(0, len(ids), BATCH):
        for i in ids[start:start + BATCH]:
            committer.add({"id": i, "error": None, "text": f"{tag}:{i}"}, "in.parquet", i)
        committer.commit()


def _finish(store: OutputStore, claim, tag: str) -> None:
    """A writer's whole run over what is not committed yet: recovery, commits, sweep, _SUCCESS."""
    manifest = Manifest(store, load_manifest(store), guard=claim)
    damaged = manifest.recover()
    if damaged:
        manifest.commit([], [r.name for r in damaged], op="repair")
    if manifest.state.fingerprint is None:
        manifest.begin({"soak": 1})
    todo = [i for i in range(NUM_ROWS) if i not in manifest.state.ok_ids]
    _commit_ids(Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=BATCH), todo, tag)
    manifest.sweep()
    write_success(store, {"rows": manifest.state.num_committed_rows})


def _stop_renewals(claim) -> None:
    if isinstance(claim, Lease):
        claim._stop.set()
        if claim._thread is not None:
            claim._thread.join()


def _poll(store: OutputStore, stop: threading.Event, result: SeedResult) -> None:
    while not stop.is_set():
        try:
            if store.is_dir("_manifest"):
                job_status(store)
                result.polls += 1
        except OutputError as e:
            if "damaged" in str(e):
                result.damaged_polls += 1
                result.notes.append(f"status: {e}")
        time.sleep(0.005)


def run_seed(seed: int, store: OutputStore, kind: str) -> SeedResult:
    """One seed of the two-writer scenario on `store` (a fresh, empty output)."""
    rng = random.Random(seed)
    result = SeedResult(seed, kind)
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(store, stop, result), daemon=True)
    poller.start()
    claim_a = _claim(store)
    claim_a.acquire()
    a_late: set[int] = set()  # ids A had not committed when it stalled
    try:
        manifest = Manifest(store, load_manifest(store), guard=claim_a)
        manifest.recover()
        manifest.begin({"soak": 1})
        committer = Committer(manifest, PartWriter(store, SCHEMA), "id", rows_per_part=BATCH)
        before = rng.randrange(1, 4) * BATCH
        _commit_ids(committer, list(range(before)), "A")
        stall_at = rng.randrange(1, 6)  # the n-th fault point of A's next commits
        events = []
        committed_before_stall: set[int] = set()

        def stall(point: str) -> None:
            if point not in FAULT_POINTS or len(events) >= stall_at:
                return
            events.append(point)
            if len(events) < stall_at:
                return
            local_files._fault_hook = None  # B's own writes run unhindered
            _stop_renewals(claim_a)
            if isinstance(claim_a, Lease):
                time.sleep(max(claim_a.expires - time.time(), 0) + 0.02)  # paused past its lease
            committed_before_stall.update(manifest.state.ok_ids)
            claim_b = _claim(store, TTL_B_S)
            try:
                claim_b.acquire()
            except OutputLocked:
                result.notes.append("B refused while A held the output")
                return
            try:
                _finish(store, claim_b, "B")
            finally:
                claim_b.release()

        local_files._fault_hook = stall
        try:
            _commit_ids(committer, list(range(before, NUM_ROWS)), "A")
            manifest.sweep()
            write_success(store, {"rows": manifest.state.num_committed_rows})
            result.a_stopped = "finished"
        except OutputLocked as e:
            result.a_stopped = "refused: " + str(e)[:60]
        finally:
            local_files._fault_hook = None
        a_late = set(range(NUM_ROWS)) - committed_before_stall if committed_before_stall else set()
    finally:
        claim_a.release()
        stop.set()
        poller.join()
    _count(store, result, a_late)
    return result


def _listed_parts(store: OutputStore) -> list[str]:
    return sorted(name for name in store.list() if PART_NAME_RE.fullmatch(name))


def _count(store: OutputStore, result: SeedResult, a_late: set[int]) -> None:
    """Rows lost / duplicated / mixed / stale, and whether _SUCCESS told the truth."""
    listed = _listed_parts(store)
    state = load_manifest(store)
    committed = set(state.parts)
    result.mixed = len(set(listed) ^ committed)
    ids, texts = [], []
    for name in listed:
        table = store.read_table(name)
        ids += table.column("id").to_pylist()
        texts += table.column("text").to_pylist()
    seen = set(ids)
    result.lost = len(set(range(NUM_ROWS)) - seen)
    result.duplicated = len(ids) - len(seen)
    # after B took over, any A row of an id A had not committed before its stall is one it committed late
    b_took_over = any(t.startswith("B:") for t in texts)
    late = sum(t.startswith("A:") and i in a_late for i, t in zip(ids, texts, strict=True))
    result.stale = late if b_took_over else 0
    result.success = store.exists(SUCCESS_FILE)
    if result.success:
        vouched = json.loads(store.read_bytes(SUCCESS_FILE)).get("rows")
        result.success_true = (not result.mixed and not result.lost and not result.duplicated
                               and vouched == len(ids) == NUM_ROWS)


BATCH_SCHEMA = pa.schema([(ID_COLUMN, pa.string()), ("url", pa.string()), ("generated_text", pa.string()),
                          ("finish_reason", pa.string()), ("num_prompt_tokens", pa.int64()),
                          ("num_generated_tokens", pa.int64()), ("error", pa.string())])
RACE_ROWS = 30  # per shard


def _batch_shard(out: Path, index: int) -> None:
    """shard-I-of-2/ of a finished OpenAI Batch job, made with the protocol's functions (no model)."""
    store = LocalStore(out / f"shard-{index}-of-2")
    store.root.mkdir(parents=True)
    with store.lock() as lock:
        manifest = Manifest(store, guard=lock)
        manifest.begin({"soak": "batch"})
        manifest.append("inputs", inputs=[], max_rows=None, split={"job_inputs": "same"})
        committer = Committer(manifest, PartWriter(store, BATCH_SCHEMA), ID_COLUMN, rows_per_part=7)
        for i in range(RACE_ROWS):
            error = "bad request" if i % 9 == 4 else None
            committer.add({ID_COLUMN: f"s{index}-{i}", "url": "/v1/chat/completions", "generated_text": f"text {i}",
                           "finish_reason": "error" if error else "stop", "num_prompt_tokens": 3,
                           "num_generated_tokens": 2, "error": error}, "in.jsonl", i)
        committer.commit()
        files = write_batch_files(store, manifest.state, ".")
        write_success(store, {"rows": manifest.state.num_committed_rows, SUCCESS_KEY: files})


def finalize_race(seed: int, out: Path) -> bool:
    """Two finalizes and a compact of a sharded job's OpenAI Batch files at once, started in a random
    order; True when the job's files are whole (every line JSON, each custom_id once, as many as
    committed) wherever `_SUCCESS` stands beside them, and at least one of the three completed."""
    rng = random.Random(seed)
    for index in range(2):
        _batch_shard(out, index)
    finalize_output(out)  # compact needs a finalized job
    outcomes: list[str] = []

    def run(action) -> None:
        time.sleep(rng.random() * 0.01)
        try:
            action(out)
            outcomes.append("done")
        except OutputLocked:
            outcomes.append("refused")

    actions = [finalize_output, finalize_output, compact_output]
    rng.shuffle(actions)
    threads = [threading.Thread(target=run, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if "done" not in outcomes:
        return False
    if not (out / SUCCESS_FILE).exists():
        return True
    data = (out / "output.jsonl").read_bytes() + (out / "errors.jsonl").read_bytes()
    if b"\x00" in data:
        return False
    try:
        ids = [json.loads(line)["custom_id"] for line in data.splitlines()]
    except ValueError:
        return False
    return len(ids) == len(set(ids)) == 2 * RACE_ROWS
