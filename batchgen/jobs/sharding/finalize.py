"""`batchgen finalize`: check that a sharded job's shards form one complete job, then write its `_SUCCESS`.

The checks, in the order a failing one is reported (each names the shard):

    every shard-I-of-N/ for I in 0..N-1 exists, holds a job, is not running and has its _SUCCESS,
    which is checked against the shard's manifest, not trusted (its rows, error rows and
    fingerprint are the manifest's, its committed rows cover the inputs its last run read, and
    every part its manifest commits is there)
        -> ShardsIncomplete (exit 4): run or resume that shard, then finalize again
    every shard was begun with the same job fingerprint (settings, model, N), read the same input
    files (the identity digest its runs recorded), and no row id is committed by two shards
        -> ShardsMismatch (exit 2): the set is not one job; rerun the odd shard with --overwrite

The id check spills each shard's ids to local disk in hash buckets (batchgen.jobs.sharding.shard_ids), so
its memory does not grow with the whole job. Then OUTPUT/_summary.json (the totals and each
shard's summary) and OUTPUT/_SUCCESS (last) are written. OUTPUT may be a local directory or an
object-store prefix (s3://bucket/prefix): the checks and files are the same, read and written
through the store (batchgen.io.store.store), and a running shard is one holding its lease.

Finalize reads the shards' manifests and writes only those two files, plus, when the shards wrote
OpenAI Batch API files (--output-format openai-batch or both), the job's own pair
(OUTPUT/output.jsonl and errors.jsonl, or OUTPUT/_openai_batch/ for both) from every shard's
committed rows, in shard order (batchgen.jobs.openai.output; the shards keep theirs). Running it
again is harmless (the same bytes), and a shard rerun that changes rows removes OUTPUT/_SUCCESS
(batchgen.jobs.commands.run).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError, ShardsIncomplete, ShardsMismatch
from batchgen.io.manifest.manifest import (
    SUCCESS_FILE,
    ManifestState,
    clear_success,
    describe_missing,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    missing_parts,
    write_success,
)
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore
from batchgen.io.store.writers import json_bytes
from batchgen.jobs.durability.fingerprint import fingerprint_changes
from batchgen.jobs.durability.session import SUMMARY_FILE
from batchgen.jobs.openai.output import (
    BATCH_BOTH_DIR,
    BATCH_FILES,
    SUCCESS_KEY,
    recorded_batch_files,
    write_batch_files,
)
from batchgen.jobs.sharding.shard_ids import SharedIdCheck
from batchgen.jobs.sharding.sharded import ShardDir, list_shard_dirs, num_shards_of, output_location, shard_dir_name


@dataclass(slots=True)
class CheckedShard:
    """What finalize keeps of a checked shard: its manifest's figures, not its ids."""

    dir: ShardDir
    fingerprint: dict[str, Any] | None
    job_inputs: str | None  # the digest of every input file's identity its runs recorded
    num_rows: int  # committed rows, error rows included
    num_rows_error: int


def check_shards(output: str | Path | OutputStore) -> list[CheckedShard]:
    """The job's shards, in order, once every check above has passed."""
    store = open_store(output)
    output = output_location(store)
    if is_job_dir(store):
        raise OutputError(f"{output} is the output of an unsharded job (it has a _manifest): its own `batchgen run` "
                          "writes its _SUCCESS; finalize is for jobs run with --num-shards")
    dirs = list_shard_dirs(store)
    if not dirs:
        raise OutputError(f"{output} holds no shard directories (shard-I-of-N/): run the shards with "
                          "`batchgen run --num-shards N --shard-index I --output DIR` first")
    num_shards = num_shards_of(output, dirs)
    by_index = {d.index: d for d in dirs}
    missing = [i for i in range(num_shards) if i not in by_index or not is_job_dir(by_index[i].store)]
    if missing:
        shown = ", ".join(map(str, missing))
        raise ShardsIncomplete(f"{output}: {len(missing)} of {num_shards} shards never started or wrote nothing "
                               f"(--shard-index {shown}; {store / shard_dir_name(missing[0], num_shards)} has no "
                               "manifest); run them, then finalize again")
    successes = [_check_complete(by_index[index]) for index in range(num_shards)]
    expected_ids = sum(int(s.get("rows") or 0) for s in successes)
    shards: list[CheckedShard] = []
    with SharedIdCheck(expected_ids) as ids:
        for index in range(num_shards):  # one shard's manifest (and ids) in memory at a time
            state = load_manifest(by_index[index].store)
            _check_success(by_index[index], successes[index], state)
            shard = CheckedShard(by_index[index], state.fingerprint, _job_inputs(state.inputs),
                                 state.num_committed_rows, len(state.error_ids))
            _check_same_job(output, shards[0] if shards else shard, shard)
            ids.add(index, itertools.chain(state.ok_ids, state.error_ids))
            shards.append(shard)
            del state
        shared = ids.first_shared()
    if shared is not None:
        row_id, first, second = shared
        raise ShardsMismatch(f"{output}: row {row_id!r} is committed by shard {first} and shard {second}; with "
                             "--id-column every id must be unique over the whole input (a row in two shards would "
                             "be output twice)")
    return shards


def _check_complete(shard: ShardDir) -> dict[str, Any]:
    """The shard's _SUCCESS, once it is known not running and complete."""
    holder = shard.store.holder()  # the local lock's or the object store's lease holder
    if holder is not None:
        raise ShardsIncomplete(f"shard {shard.index} of {shard.num_shards} ({shard.path}) is still running (pid "
                               f"{holder.get('pid')} on {holder.get('host')}); finalize once it has finished")
    try:
        success = json.loads(shard.store.read_bytes(SUCCESS_FILE) or b"{}")
    except FileNotFoundError:
        why = _why_incomplete(shard.store)
        raise ShardsIncomplete(f"shard {shard.index} of {shard.num_shards} ({shard.path}) did not complete ({why}); "
                               "rerun its `batchgen run` command to resume it, then finalize again") from None
    except ValueError:  # a _SUCCESS of another writer: it counts, its figures do not
        success = {}
    return success if isinstance(success, dict) else {}


def _check_success(shard: ShardDir, success: dict[str, Any], state: ManifestState) -> None:
    """The shard's _SUCCESS re-derived from its manifest, not trusted: its figures (where it has
    them) are the manifest's, the committed rows cover every input row its last run read, and every
    committed part is there (batchgen.io.manifest.success). A _SUCCESS left from before a rerun changed
    rows fails here, and so does one over a part that vanished after it was written."""
    derived = {"rows": state.num_committed_rows, "rows_error": len(state.error_ids),
               "fingerprint": fingerprint_digest(state.fingerprint)}
    stale = [f"{key} {success[key]!r} (the manifest: {value!r})" for key, value in derived.items()
             if key in success and success[key] != value]
    inputs = (state.inputs or {}).get("inputs") or []
    num_input_rows = sum(int(i.get("num_rows") or 0) for i in inputs)
    if not stale and state.num_committed_rows < num_input_rows:
        stale = [f"{state.num_committed_rows} rows committed of the {num_input_rows} its last run read"]
    missing = [] if stale else missing_parts(shard.store, state)
    if missing:
        stale = [describe_missing(missing)]
    if stale:
        raise ShardsIncomplete(f"shard {shard.index} of {shard.num_shards} ({shard.path}) has a {SUCCESS_FILE} that "
                               f"does not match its manifest: {'; '.join(stale)}; rerun its `batchgen run` command "
                               "to resume it, then finalize again")


def _why_incomplete(store: OutputStore) -> str:
    """The shard's last summary says how far it got, and why it stopped where it knows."""
    summary = _read_summary(store)
    if summary is None:
        return f"no {SUCCESS_FILE}"
    rows, errors = summary.get("output_rows"), summary.get("output_rows_error")
    if summary.get("complete") is False and not summary.get("partial"):
        return f"no {SUCCESS_FILE}: {errors} of {rows} rows failed, more than its --max-error-rate"
    return f"no {SUCCESS_FILE}: it stopped after committing {rows} rows"


def _read_summary(store: OutputStore) -> dict[str, Any] | None:
    try:
        summary = json.loads(store.read_bytes(SUMMARY_FILE))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _check_same_job(output: Path | OutputStore, first: CheckedShard, shard: CheckedShard) -> None:
    name = shard.dir.store.name
    if fingerprint_digest(shard.fingerprint) != fingerprint_digest(first.fingerprint):
        changes = fingerprint_changes(first.fingerprint or {}, shard.fingerprint or {}) or ["model settings"]
        raise ShardsMismatch(f"{output}: {name} was run with other settings than {first.dir.store.name}: "
                             f"{'; '.join(changes[:5])}. Every shard of a job runs the same command but for "
                             f"--shard-index: rerun {name} with the job's settings and --overwrite")
    if shard.job_inputs != first.job_inputs:
        raise ShardsMismatch(f"{output}: {name} read other input files than {first.dir.store.name} (files added, "
                             "removed or changed between their runs move the split); rerun every shard with "
                             "--overwrite over the same inputs")


def _job_inputs(inputs: dict[str, Any] | None) -> str | None:
    split = (inputs or {}).get("split") or {}
    return split.get("job_inputs")


def finalize_output(output: str | Path | OutputStore) -> dict[str, Any]:
    """Check the set (check_shards), then write OUTPUT/_summary.json and OUTPUT/_SUCCESS; the summary.

    Holds OUTPUT's own lock (or lease) throughout: two finalizes, or a finalize and a compact of the
    job, would otherwise write the job's Batch files and _SUCCESS at once."""
    store = open_store(output)
    with store.lock():
        return finalize_locked(store)


def finalize_locked(store: OutputStore) -> dict[str, Any]:
    """finalize_output, for a caller that holds OUTPUT's lock (compact of a sharded job)."""
    output = output_location(store)
    shards = check_shards(store)
    per_shard = [{"index": shard.dir.index, "output": str(shard.dir.path), "rows": shard.num_rows,
                  "rows_error": shard.num_rows_error, "summary": _read_summary(shard.dir.store)} for shard in shards]
    digest = fingerprint_digest(shards[0].fingerprint)
    rows = sum(s["rows"] for s in per_shard)
    rows_error = sum(s["rows_error"] for s in per_shard)
    result = {"output": str(output), "num_shards": len(shards), "rows": rows, "rows_error": rows_error,
              "fingerprint": digest, "finalized": time.time(), "shards": per_shard}
    success = {"rows": rows, "rows_error": rows_error, "fingerprint": digest, "num_shards": len(shards),
               "finished": result["finalized"]}
    batch_dir = _shards_batch_dir(output, shards)
    clear_success(store)  # no _SUCCESS beside a Batch pair being replaced (jobs/openai/output.py)
    _remove_job_batch_files(store, keep=batch_dir)
    if batch_dir is not None:  # the job's Batch files, from every shard's committed parts
        sources = [(s.dir.store, load_manifest(s.dir.store, with_ids=False)) for s in shards]  # parts, not ids
        created = max(int(recorded_batch_files(s.dir.store).get("created") or 0) for s in shards) or None
        success[SUCCESS_KEY] = write_batch_files(store, sources[0][1], batch_dir, created=created, sources=sources)
        result[SUCCESS_KEY] = success[SUCCESS_KEY]
    store.write_bytes(SUMMARY_FILE, json_bytes(result))
    write_success(store, success)
    return result


def _shards_batch_dir(output: Path | OutputStore, shards: list[CheckedShard]) -> str | None:
    """Where the shards wrote OpenAI Batch files ("." or BATCH_BOTH_DIR, as their _SUCCESS records),
    the job's files going to the same place; None when they wrote none. Every shard alike."""
    dirs = {s.dir.index: (recorded_batch_files(s.dir.store) or {}).get("dir") for s in shards}
    if len(set(dirs.values())) > 1:
        odd = next(i for i, d in dirs.items() if d != dirs[shards[0].dir.index])
        raise ShardsMismatch(f"{output}: shard {odd} was run with another --output-format than shard "
                             f"{shards[0].dir.index}; rerun it with the job's --output-format, then finalize again")
    return dirs[shards[0].dir.index]


def _remove_job_batch_files(store: OutputStore, keep: str | None) -> None:
    """An earlier finalize's Batch files where this one writes none (another --output-format)."""
    for dir_name in (".", BATCH_BOTH_DIR):
        if dir_name != keep:
            for name in BATCH_FILES:
                store.delete(name if dir_name == "." else f"{dir_name}/{name}")
