"""`batchgen finalize`: check that a sharded job's shards form one complete job, then write its `_SUCCESS`.

The checks, in the order a failing one is reported (each names the shard):

    every shard-I-of-N/ for I in 0..N-1 exists, holds a job, is not running and has its _SUCCESS
        -> ShardsIncomplete (exit 4): run or resume that shard, then finalize again
    every shard was begun with the same job fingerprint (settings, model, N), read the same input
    files (the identity digest its runs recorded), and no row id is committed by two shards
        -> ShardsMismatch (exit 2): the set is not one job; rerun the odd shard with --overwrite

Then OUTPUT/_summary.json (the totals and each shard's summary) and OUTPUT/_SUCCESS (last) are
written. Finalize reads the shards' manifests and writes only those two files, plus, when the shards
wrote OpenAI Batch API files (--output-format openai-batch or both), the job's own pair
(OUTPUT/output.jsonl and errors.jsonl, or OUTPUT/_openai_batch/ for both) from every shard's
committed rows, in shard order (batchgen.jobs.openai_output; the shards keep theirs). Running it
again is harmless (the same bytes), and a shard rerun that changes rows removes OUTPUT/_SUCCESS
(batchgen.jobs.run).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import ConfigError, OutputError, ShardsIncomplete, ShardsMismatch
from batchgen.io.lock import lock_holder
from batchgen.io.manifest import (
    SUCCESS_FILE,
    ManifestState,
    clear_success,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
)
from batchgen.io.writers import write_json_atomic
from batchgen.jobs.fingerprint import fingerprint_changes
from batchgen.jobs.openai_output import SUCCESS_KEY, recorded_batch_files, write_batch_files
from batchgen.jobs.session import BATCH_BOTH_DIR, BATCH_FILES, SUMMARY_FILE
from batchgen.jobs.sharded import ShardDir, list_shard_dirs, num_shards_of
from batchgen.jobs.split import shard_dir_name


@dataclass(slots=True)
class CheckedShard:
    dir: ShardDir
    state: ManifestState


def check_shards(output: str | Path) -> list[CheckedShard]:
    """The job's shards, in order, once every check above has passed."""
    output = Path(output)
    if is_job_dir(output):
        raise OutputError(f"{output} is the output of an unsharded job (it has a _manifest): its own `batchgen run` "
                          "writes its _SUCCESS; finalize is for jobs run with --num-shards")
    dirs = list_shard_dirs(output)
    if not dirs:
        raise OutputError(f"{output} holds no shard directories (shard-I-of-N/): run the shards with "
                          "`batchgen run --num-shards N --shard-index I --output DIR` first")
    num_shards = num_shards_of(output, dirs)
    by_index = {d.index: d for d in dirs}
    missing = [i for i in range(num_shards) if i not in by_index or not is_job_dir(by_index[i].path)]
    if missing:
        shown = ", ".join(map(str, missing))
        raise ShardsIncomplete(f"{output}: {len(missing)} of {num_shards} shards never started or wrote nothing "
                               f"(--shard-index {shown}; {output / shard_dir_name(missing[0], num_shards)} has no "
                               "manifest); run them, then finalize again")
    shards = []
    for index in range(num_shards):
        shard_dir = by_index[index]
        _check_complete(shard_dir)
        state = load_manifest(shard_dir.path)
        shards.append(CheckedShard(shard_dir, state))
    _check_one_job(output, shards)
    return shards


def _check_complete(shard: ShardDir) -> None:
    holder = lock_holder(shard.path)
    if holder is not None:
        raise ShardsIncomplete(f"shard {shard.index} of {shard.num_shards} ({shard.path}) is still running (pid "
                               f"{holder.get('pid')} on {holder.get('host')}); finalize once it has finished")
    if not (shard.path / SUCCESS_FILE).is_file():
        why = _why_incomplete(shard.path)
        raise ShardsIncomplete(f"shard {shard.index} of {shard.num_shards} ({shard.path}) did not complete ({why}); "
                               "rerun its `batchgen run` command to resume it, then finalize again")


def _why_incomplete(path: Path) -> str:
    """The shard's last summary says how far it got, and why it stopped where it knows."""
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return f"no {SUCCESS_FILE}"
    rows, errors = summary.get("output_rows"), summary.get("output_rows_error")
    if summary.get("complete") is False and not summary.get("partial"):
        return f"no {SUCCESS_FILE}: {errors} of {rows} rows failed, more than its --max-error-rate"
    return f"no {SUCCESS_FILE}: it stopped after committing {rows} rows"


def _check_one_job(output: Path, shards: list[CheckedShard]) -> None:
    first = shards[0]
    first_digest = fingerprint_digest(first.state.fingerprint)
    first_inputs = _job_inputs(first)
    owner: dict[Any, int] = {}
    for shard in shards:
        name, fingerprint = shard.dir.path.name, shard.state.fingerprint
        if fingerprint_digest(fingerprint) != first_digest:
            changes = fingerprint_changes(first.state.fingerprint or {}, fingerprint or {}) or ["model settings"]
            raise ShardsMismatch(f"{output}: {name} was run with other settings than {first.dir.path.name}: "
                                 f"{'; '.join(changes[:5])}. Every shard of a job runs the same command but for "
                                 f"--shard-index: rerun {name} with the job's settings and --overwrite")
        if _job_inputs(shard) != first_inputs:
            raise ShardsMismatch(f"{output}: {name} read other input files than {first.dir.path.name} (files added, "
                                 "removed or changed between their runs move the split); rerun every shard with "
                                 "--overwrite over the same inputs")
        for row_id in (*shard.state.ok_ids, *shard.state.error_ids):
            other = owner.setdefault(row_id, shard.dir.index)
            if other != shard.dir.index:
                raise ShardsMismatch(f"{output}: row {row_id!r} is committed by shard {other} and shard "
                                     f"{shard.dir.index}; with --id-column every id must be unique over the whole "
                                     "input (a row in two shards would be output twice)")


def _job_inputs(shard: CheckedShard) -> str | None:
    split = (shard.state.inputs or {}).get("split") or {}
    return split.get("job_inputs")


def finalize_output(output: str | Path) -> dict[str, Any]:
    """Check the set (check_shards), then write OUTPUT/_summary.json and OUTPUT/_SUCCESS; the summary."""
    from batchgen.io.store import is_url

    if is_url(output):  # sharded jobs are refused with an object-store output (JobConfig.validate)
        raise ConfigError(f"finalize --output {output}: sharded jobs need a local or mounted output directory; "
                          "an object-store output is never sharded")
    output = Path(output)
    shards = check_shards(output)
    per_shard = []
    for shard in shards:
        try:
            summary = json.loads((shard.dir.path / SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            summary = None
        per_shard.append({"index": shard.dir.index, "output": str(shard.dir.path),
                          "rows": shard.state.num_committed_rows, "rows_error": len(shard.state.error_ids),
                          "summary": summary})
    digest = fingerprint_digest(shards[0].state.fingerprint)
    rows = sum(s["rows"] for s in per_shard)
    rows_error = sum(s["rows_error"] for s in per_shard)
    result = {"output": str(output), "num_shards": len(shards), "rows": rows, "rows_error": rows_error,
              "fingerprint": digest, "finalized": time.time(), "shards": per_shard}
    success = {"rows": rows, "rows_error": rows_error, "fingerprint": digest, "num_shards": len(shards),
               "finished": result["finalized"]}
    batch_dir = _shards_batch_dir(output, shards)
    clear_success(output)  # no _SUCCESS beside a Batch pair being replaced (jobs/openai_output.py)
    _remove_job_batch_files(output, keep=batch_dir)
    if batch_dir is not None:
        created = max(int(recorded_batch_files(s.dir.path).get("created") or 0) for s in shards) or None
        success[SUCCESS_KEY] = write_batch_files(output, shards[0].state, batch_dir, created=created,
                                                 sources=[(s.dir.path, s.state) for s in shards])
        result[SUCCESS_KEY] = success[SUCCESS_KEY]
    write_json_atomic(output / SUMMARY_FILE, result)
    write_json_atomic(output / SUCCESS_FILE, success)
    return result


def _shards_batch_dir(output: Path, shards: list[CheckedShard]) -> str | None:
    """Where the shards wrote OpenAI Batch files ("." or BATCH_BOTH_DIR, as their _SUCCESS records),
    the job's files going to the same place; None when they wrote none. Every shard alike."""
    dirs = {s.dir.index: (recorded_batch_files(s.dir.path) or {}).get("dir") for s in shards}
    if len(set(dirs.values())) > 1:
        odd = next(i for i, d in dirs.items() if d != dirs[shards[0].dir.index])
        raise ShardsMismatch(f"{output}: shard {odd} was run with another --output-format than shard "
                             f"{shards[0].dir.index}; rerun it with the job's --output-format, then finalize again")
    return dirs[shards[0].dir.index]


def _remove_job_batch_files(output: Path, keep: str | None) -> None:
    """An earlier finalize's Batch files where this one writes none (another --output-format)."""
    for dir_name in (".", BATCH_BOTH_DIR):
        if dir_name != keep:
            for name in BATCH_FILES:
                (output / dir_name / name).unlink(missing_ok=True)
