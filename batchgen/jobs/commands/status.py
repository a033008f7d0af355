"""`batchgen status`: what an output directory holds, for Airflow sensors and for people.

Read-only: it takes no lock and changes nothing, so it is safe to poll while a job runs. The
counts come from the manifest (batchgen.io.manifest.manifest): committed rows per input file, split
into ok ("done") and error rows, against the row counts the latest run recorded for its inputs.
A sharded job's OUTPUT shows every shard and the totals (batchgen.jobs.sharding.sharded).

Every state it reports exits 0, "not_started" included (an output that does not exist yet, or
holds only a starting run's lock): a sensor polls before the first run without failing. Exit 2
is kept for a directory that holds something else.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, is_job_dir, load_manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_FILE
from batchgen.io.store.lock import LOCK_FILE
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.durability.fingerprint import fingerprint_summary
from batchgen.jobs.pipeline.summary import plural
from batchgen.jobs.sharding.sharded import (
    is_sharded_output,
    list_shard_dirs,
    num_shards_of,
    output_location,
    shard_dir_name,
)
from batchgen.monitor.live import live_figures

NOT_STARTED = "not_started"  # `status` exits 0 for it, as for every state it reports


def job_status(out_dir: str | Path | OutputStore) -> dict[str, Any]:
    """The status as plain JSON-ready data (the `--json` output)."""
    store = open_store(out_dir)
    out_dir = store.path() if isinstance(store, LocalStore) else store
    # a sharded job (a local directory or an object-store prefix): every shard, and the totals over the set
    if is_sharded_output(store):
        return sharded_status(store)
    if not is_job_dir(store):
        if _not_started(store):
            return _not_started_status(out_dir, store.holder())
        raise OutputError(f"{out_dir} is not a batchgen output directory (it has no _manifest)")
    state = load_manifest(store, with_ids=False)  # counts only: O(parts) after a snapshot
    done: dict[str, list[int]] = {}
    for record in state.parts.values():
        for path, (num_ok, num_error) in record.file_counts.items():
            counts = done.setdefault(path, [0, 0])
            counts[0] += num_ok
            counts[1] += num_error
    inputs = state.inputs["inputs"] if state.inputs else []
    files = []
    for file in inputs:
        num_ok, num_error = done.pop(file["path"], (0, 0))
        files.append(_file(file["path"], file["num_rows"], num_ok, num_error))
    for path, (num_ok, num_error) in sorted(done.items()):  # committed by a run with other inputs
        files.append(_file(path, None, num_ok, num_error))
    holder = store.holder()  # the local lock's or the object store's lease holder
    complete = store.exists(SUCCESS_FILE)
    totals = {key: sum(f[key] or 0 for f in files) for key in ("rows", "done", "errored", "remaining")}
    state_name = "running" if holder is not None else "complete" if complete else "incomplete"
    return {
        "output": str(out_dir),
        "state": state_name,
        "complete": complete,
        "running": holder,
        "max_rows": state.inputs.get("max_rows") if state.inputs else None,
        # committed rows whose --id-column id the latest run did not find in its input: kept, not deleted
        "orphans": state.inputs.get("orphans") if state.inputs else None,
        **totals,
        "files": files,  # per input file
        "fingerprint": fingerprint_summary(state.fingerprint),
        "last_commit_time": state.last_commit_time,
        "num_parts": len(state.parts),
        # rows in flight when a job stopped, checkpointed: a resume continues them (never output rows)
        "partial_rows": state.partials["num_rows"] if state.partials else 0,
        "partial_tokens": state.partials["num_tokens"] if state.partials else 0,
        "num_entries": state.last_seq,
        # from _metrics/ (batchgen.monitor.live): tokens/s over the last minute, ETA; None without metrics
        # (an object-store output keeps no metrics files: None)
        "live": live_figures(out_dir, running=state_name == "running", complete=complete)
        if isinstance(store, LocalStore) else None,
    }


def _not_started(store: OutputStore) -> bool:
    """Nothing there yet, or only what a run leaves before its first commit (its lock or lease,
    hidden temp files): the output of a job that has not started, not someone else's directory."""
    return all(name in (LOCK_FILE, LEASE_FILE) or (name.startswith(".") and name.endswith(".tmp"))
               for name in store.list())


def _not_started_status(out_dir, holder: dict[str, Any] | None) -> dict[str, Any]:
    """A job no run has committed to yet: a state like any other (exit 0), so that a sensor polling
    an output before its first run sees "not started", not a failure."""
    return {"output": str(out_dir), "state": NOT_STARTED if holder is None else "starting", "complete": False,
            "running": holder, "max_rows": None, "orphans": None, "rows": 0, "done": 0, "errored": 0,
            "remaining": None, "files": [], "fingerprint": None, "last_commit_time": None, "num_parts": 0,
            "partial_rows": 0, "partial_tokens": 0, "num_entries": 0, "live": None}


def _file(path: str, num_rows: int | None, num_ok: int, num_error: int) -> dict[str, Any]:
    remaining = None if num_rows is None else max(num_rows - num_ok - num_error, 0)
    return {"path": path, "rows": num_rows, "done": num_ok, "errored": num_error, "remaining": remaining}


def status_lines(status: dict[str, Any]) -> list[str]:
    """The same, for a terminal."""
    if "job_shards" in status:
        return sharded_status_lines(status)
    state = status["state"]
    if state in (NOT_STARTED, "starting"):
        what = "not started: no run has written there yet" if state == NOT_STARTED else (
            f"starting: a run (pid {(status['running'] or {}).get('pid')}) holds it, nothing committed yet")
        return [f"output: {status['output']}", f"state: {what}"]
    if state == "running":
        holder = status["running"] or {}
        state = f"running (pid {holder.get('pid')} on {holder.get('host')})"
    elif state == "incomplete":
        state = "incomplete: run the same `batchgen run` command again to resume"
    limit = f" (--max-rows {status['max_rows']})" if status["max_rows"] is not None else ""
    lines = [
        f"output: {status['output']}",
        f"state: {state}",
        f"rows{limit}: {status['rows']} in the input, {status['done']} done, {status['errored']} errored, "
        f"{status['remaining']} remaining",
    ]
    for file in status["files"]:
        rows = "?" if file["rows"] is None else file["rows"]
        remaining = "?" if file["remaining"] is None else file["remaining"]
        lines.append(f"  {file['path']}: {rows} rows, {file['done']} done, {file['errored']} errored, "
                     f"{remaining} remaining")
    orphans = status.get("orphans")
    if orphans and orphans["num_rows"]:
        examples = ", ".join(map(repr, orphans["examples"]))
        lines.append(f"{orphans['num_rows']} committed rows whose id is no longer in the input (e.g. {examples}): "
                     "kept in the output; filter them by id, or pass --overwrite to start over")
    fingerprint = status["fingerprint"]
    if fingerprint is not None:
        task = fingerprint.get("task", "generate")  # embed / score / classify generate nothing: no output settings
        settings = (f"max_new_tokens {fingerprint.get('max_new_tokens')}, temperature {fingerprint.get('temperature')}"
                    if task == "generate" else f"task {task}")
        lines.append(f"fingerprint: {fingerprint['digest']} (model {fingerprint.get('model')} revision "
                     f"{fingerprint.get('model_revision')}, {settings}, "
                     f"output format {fingerprint.get('output_format', 0)})")
    if status.get("partial_rows"):
        lines.append(f"in flight when stopped: {status['partial_rows']} rows with {status['partial_tokens']} tokens "
                     "generated, checkpointed; a resume continues them")
    last = status["last_commit_time"]
    if last is None:
        lines.append("last commit: none yet")
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last))
        lines.append(f"last commit: {stamp} ({time.time() - last:.0f} s ago); {plural(status['num_parts'], 'part')}")
    live = status.get("live")
    if live is not None:
        eta = "" if live["eta_seconds"] is None else f", ETA {live['eta_seconds']:.0f} s"
        lines.append(f"metrics: input {live['input_tokens_per_s_last_minute']:.1f} tok/s, output "
                     f"{live['tokens_per_s_last_minute']:.1f} tok/s over the last minute of records{eta}; "
                     f"{live['tokens_generated']} tokens generated in {live['engine_steps']} engine steps")
    return lines


def sharded_status(output: str | Path | OutputStore) -> dict[str, Any]:
    """`batchgen status` of a sharded job: every shard's status, and the totals over the set."""
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
        inputs += [{**f, "job_shard": index} for f in status["files"]]
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
        "files": inputs,  # the input files (a file cut between shards: once per shard)
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
