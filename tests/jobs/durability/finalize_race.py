"""Two finalizes and a compact of a sharded job's OpenAI Batch files at once (`finalize_race`), for
tests/jobs/durability/test_fault_soak.py (a few seeds) and benchmarks/soaks/fault_soak.py (more)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pyarrow as pa

from batchgen.errors import OutputLocked
from batchgen.io.inputs.openai_batch import ID_COLUMN
from batchgen.io.manifest.manifest import SUCCESS_FILE, Manifest, write_success
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.openai.output import SUCCESS_KEY, write_batch_files
from batchgen.jobs.sharding.finalize import finalize_output

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
