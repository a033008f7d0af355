"""A sharded job's output directory as a whole: its shard directories, and `status` and `compact` over them.

    OUTPUT/shard-0-of-N/ ... shard-(N-1)-of-N/   one ordinary job directory per shard (manifest, lock,
                                                  parts, its own _SUCCESS), written by `run --shard-index I`
    OUTPUT/_SUCCESS, OUTPUT/_summary.json         written by `batchgen finalize` once the set is checked
    OUTPUT/output.jsonl, errors.jsonl             the job's OpenAI Batch files, by finalize too, when the shards
      (or OUTPUT/_openai_batch/ for `both`)       ran with --output-format openai-batch or both

OUTPUT is a local directory or an object-store prefix (s3://bucket/prefix, batchgen.io.store.store):
each shard-I-of-N/ is then a prefix with its own manifest and lease, and finalize writes the job's
files with one PUT each, _SUCCESS last.

A reader of the whole output (`pyarrow.dataset` over OUTPUT, Spark, DuckDB's `**/*.parquet`) sees
every shard's parts: the bookkeeping names start with "_" or "." and are skipped by them. It waits
for OUTPUT/_SUCCESS, as it would for one directory's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, clear_success, is_job_dir
from batchgen.io.store.store import LocalStore, OutputStore, open_store
from batchgen.jobs.durability.session import BATCH_BOTH_DIR, BATCH_FILES
from batchgen.jobs.sharding.split import parse_shard_dir, shard_dir_name

log = logging.getLogger("batchgen")

# what finalize writes beside the shard directories (the OpenAI Batch files of openai-batch/both jobs)
JOB_FILES = (SUCCESS_FILE, "_summary.json", *BATCH_FILES, BATCH_BOTH_DIR)


@dataclass(frozen=True, slots=True)
class ShardDir:
    index: int
    num_shards: int
    store: OutputStore  # OUTPUT/shard-I-of-N/: a local directory or an object-store prefix

    @property
    def path(self) -> Path | OutputStore:
        """A local Path where there is one, else the store (its str is the URL): what messages show."""
        return self.store.path() if isinstance(self.store, LocalStore) else self.store


def output_location(output: str | Path | OutputStore) -> Path | OutputStore:
    """The store's local Path where it has one, else the store: what messages and results show."""
    store = open_store(output)
    return store.path() if isinstance(store, LocalStore) else store


def list_shard_dirs(output: str | Path | OutputStore) -> list[ShardDir]:
    """The shard-I-of-N/ directories (or prefixes) under OUTPUT, by N then I."""
    store = open_store(output)
    found = []
    for name, size in store.list().items():
        parsed = parse_shard_dir(name) if size is None else None  # None: a directory / common prefix
        if parsed is not None:
            found.append(ShardDir(parsed[0], parsed[1], store.sub(name)))
    return sorted(found, key=lambda d: (d.num_shards, d.index))


def is_sharded_output(output: str | Path | OutputStore) -> bool:
    return not is_job_dir(output) and bool(list_shard_dirs(output))


def num_shards_of(output: Path | OutputStore, dirs: list[ShardDir]) -> int:
    """The one N of the set; shards of two splits (another --num-shards) are refused."""
    splits = sorted({d.num_shards for d in dirs})
    if len(splits) > 1:
        raise OutputError(f"{output} holds shards of {len(splits)} different splits (--num-shards "
                          f"{', '.join(map(str, splits))}); one job has one split: remove the directories of the "
                          "other, or rerun every shard into a new --output")
    return splits[0]


def check_job_output(output: str | Path | OutputStore, num_shards: int) -> None:
    """Before a shard runs: OUTPUT must be new, empty, or this sharded job's (shards of the same N)."""
    store = open_store(output)
    output = output_location(store)
    if is_job_dir(store):
        raise OutputError(f"{output} holds the output of an unsharded job (it has a _manifest); a sharded job "
                          "needs its own --output directory")
    names = store.list()
    if not names:
        return
    others = sorted({d.num_shards for d in list_shard_dirs(store)} - {num_shards})
    if others:
        raise OutputError(f"{output} holds shards of a {others[0]}-shard split ({shard_dir_name(0, others[0])}/, "
                          f"...); every shard of a job runs with the same --num-shards: pass --num-shards "
                          f"{others[0]}, or choose a new --output")
    ours = {shard_dir_name(i, num_shards) for i in range(num_shards)} | set(JOB_FILES)
    foreign = sorted(name for name in names if name not in ours and not name.startswith("."))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputError(f"{output} is not empty and is not a sharded batchgen job's output directory (it holds "
                          f"{shown}); readers of the whole output would read those too: choose a new or empty "
                          "--output directory")


def sharded_status(output: str | Path | OutputStore) -> dict[str, Any]:
    """`batchgen status` of a sharded job: every shard's status, and the totals over the set."""
    from batchgen.jobs.commands.status import job_status  # the one-directory status, per shard

    store = open_store(output)
    output = output_location(store)
    dirs = list_shard_dirs(store)
    num_shards = num_shards_of(output, dirs)
    by_index = {d.index: d for d in dirs}
    per_shard, inputs, fingerprint = [], [], None
    for index in range(num_shards):
        shard_dir = by_index.get(index)
        if shard_dir is None or not is_job_dir(shard_dir.store):
            per_shard.append({"index": index, "output": str(store / shard_dir_name(index, num_shards)),
                              "state": "not started", "rows": None, "done": 0, "errored": 0, "remaining": None,
                              "fingerprint": None})
            continue
        status = job_status(shard_dir.store)
        per_shard.append({"index": index, **{key: status[key] for key in (
            "output", "state", "rows", "done", "errored", "remaining", "running", "last_commit_time", "num_parts",
            "partial_rows", "live")}, "fingerprint": (status["fingerprint"] or {}).get("digest")})
        inputs += [{**s, "job_shard": index} for s in status["shards"]]
        fingerprint = status["fingerprint"] or fingerprint
    complete = store.exists(SUCCESS_FILE)
    running = [s["running"] for s in per_shard if s.get("running")]
    states = {s["state"] for s in per_shard}
    state = "complete" if complete else "running" if running else (
        "unfinalized" if states == {"complete"} else "incomplete")
    digests = {s["fingerprint"] for s in per_shard if s["fingerprint"] is not None}
    totals = {key: sum(s[key] or 0 for s in per_shard) for key in ("done", "errored")}
    known = all(s["rows"] is not None for s in per_shard)
    commits = [s["last_commit_time"] for s in per_shard if s.get("last_commit_time") is not None]
    return {
        "output": str(output), "state": state, "complete": complete, "running": running or None,
        "num_shards": num_shards,
        "shards_complete": sum(s["state"] == "complete" for s in per_shard),
        "rows": sum(s["rows"] for s in per_shard) if known else None, **totals,
        "remaining": sum(s["remaining"] or 0 for s in per_shard) if known else None,
        "shards": inputs,  # the input files (a file cut between shards: once per shard)
        "job_shards": per_shard,
        "fingerprint": fingerprint if len(digests) == 1 else None,
        "fingerprints_differ": len(digests) > 1,
        "last_commit_time": max(commits) if commits else None,
        "num_parts": sum(s.get("num_parts") or 0 for s in per_shard),
        "partial_rows": sum(s.get("partial_rows") or 0 for s in per_shard),
        "max_rows": None, "orphans": None, "live": None,
    }


def sharded_status_lines(status: dict[str, Any]) -> list[str]:
    state = {"unfinalized": "every shard complete; run `batchgen finalize --output DIR` to mark the job done",
             "incomplete": "incomplete: run (or rerun, to resume) the shards not complete, then `batchgen "
                           "finalize`"}.get(status["state"], status["state"])
    rows = "?" if status["rows"] is None else status["rows"]
    remaining = "?" if status["remaining"] is None else status["remaining"]
    lines = [f"output: {status['output']} (sharded: {status['num_shards']} shards, {status['shards_complete']} "
             "complete)",
             f"state: {state}",
             f"rows: {rows} in the input, {status['done']} done, {status['errored']} errored, {remaining} remaining"]
    for s in status["job_shards"]:
        what = s["state"] if s["state"] != "running" else f"running (pid {(s['running'] or {}).get('pid')})"
        lines.append(f"  shard {s['index']}: {what}, {'?' if s['rows'] is None else s['rows']} rows, {s['done']} "
                     f"done, {s['errored']} errored, fingerprint {s['fingerprint']}")
    if status["fingerprints_differ"]:
        lines.append("the shards' fingerprints differ: they were run with other settings (finalize will refuse)")
    elif status["fingerprint"] is not None:
        lines.append(f"fingerprint: {status['fingerprint']['digest']}")
    return lines


def compact_sharded(output: str | Path | OutputStore):
    """`batchgen compact` over a finalized sharded job: each shard compacted, then the job's
    _SUCCESS written again. While it runs the job has no _SUCCESS (readers wait, as for one directory)."""
    from batchgen.jobs.commands.compact import CompactSummary, compact_output
    from batchgen.jobs.commands.finalize import check_shards, finalize_locked

    store = open_store(output)
    output = output_location(store)
    with store.lock():  # the job's own lock, as finalize holds it: never both writing the job's files
        if not store.exists(SUCCESS_FILE):
            raise OutputError(f"{output} is a sharded job not finalized (no {SUCCESS_FILE}); run `batchgen "
                              f"finalize --output {output}` first")
        shards = check_shards(store)  # the set is whole before anything is rewritten
        clear_success(store)
        before = after = rows = 0
        for shard in shards:
            result = compact_output(shard.dir.store)
            before, after = before + result.num_parts_before, after + result.num_parts_after
            rows += result.num_rows
        finalize_locked(store)
    return CompactSummary(str(output), before, after, rows)
