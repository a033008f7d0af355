"""The OpenAI Batch API output files, written from a job's committed rows: `output.jsonl`, `errors.jsonl`.

One line per committed request (its `n` samples are its choices, index = sample_index, from the
rows the job writes next to each other; usage counts the prompt once and every choice's tokens),
successes in OUTPUT_FILE and error rows in ERRORS_FILE, as the API
splits them (its output and error files). `--output-format openai-batch` writes them into the
output directory; `both` into its `_openai_batch/` subdirectory, because a JSON Lines file beside
the parts would stop `pyarrow.dataset` (or Spark) from reading the directory as one Parquet table.
A `.jsonl` --output gets every line in that one file instead (batchgen.jobs.openai.batch_file).

    {"id": "batch_req_…", "custom_id": …, "response": {"status_code": 200, "request_id": "req_…",
     "body": <a chat.completion or text_completion object with choices, usage, model, created>},
     "error": null}

An error row is answered as the API answers a request it rejects: status_code 400 and a body
{"error": {"message", "type": "invalid_request_error", "param", "code"}} (the code kept in
the row's message, batchgen.io.inputs.openai_batch.split_api_error), top-level "error" null.
An embed job's requests (/v1/embeddings) are answered with a `list` of embeddings instead
(batchgen.jobs.openai.embedding_output).

Exactly once. The Parquet parts and the manifest stay the commit point; these files are derived
from them, whole, once the job has every row: by the run that completes it, by a rerun of a
complete job, and by `batchgen compact`. The caller removes `_SUCCESS` first and writes it after
(jobs/commands/run.py), and `write_batch_files` writes both files under hidden temporary names, fsyncs
them, removes the old pair, then renames the new pair into place. Old and new lines are never
visible together, so a kill at any moment leaves no line twice; a pair without `_SUCCESS` beside it
may be incomplete, and the next run or compact writes it again. On an object store (no rename) the
old pair is deleted first and each new file is streamed to its final name, an object only once it
is whole (batchgen.io.store.object_store.ObjectStore.open_stream); `_SUCCESS` is still removed before and
written after, so the same holds. Everything in a line is derived
from committed data (ids are digests of the job fingerprint and the custom_id, `created` is the
last commit's time, kept by compact), so writing the files again gives the same bytes.

`model` in a response body is the model the job ran (the fingerprint's); what each request asked
for is the `model` column of the Parquet output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.config.job import OPENAI_BATCH
from batchgen.errors import OutputError
from batchgen.io.inputs.openai_batch import CHAT_URL, ID_COLUMN, split_api_error
from batchgen.io.manifest.manifest import SUCCESS_FILE, ManifestState, clear_success, fingerprint_digest
from batchgen.io.store.factory import open_store
from batchgen.io.store.local_files import TEMP_SUFFIX, fault_point, fsync_dir
from batchgen.io.store.schema import EMBEDDING, SAMPLE_INDEX
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.openai.batch_file import batch_file_present, batch_file_target, clear_batch_file, write_batch_file
from batchgen.jobs.openai.embedding_output import BODY_COLUMN, RequestRefused, embeddings_body
from batchgen.jobs.openai.temp_files import open_held, sweep_dead_temps

log = logging.getLogger("batchgen")

# the files written here from the committed rows: in the output directory itself (--output-format
# openai-batch), or in BOTH_DIR beside a Parquet dataset that readers of the directory
# (pyarrow.dataset, Spark) must still read as one (--output-format both)
BATCH_FILES = ("output.jsonl", "errors.jsonl")
BATCH_BOTH_DIR = "_openai_batch"
OUTPUT_FILE, ERRORS_FILE = BATCH_FILES
SUCCESS_KEY = "openai_batch"  # in _SUCCESS: where the files are, and the commit sequence number they hold
_COLUMNS = [ID_COLUMN, "url", "generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens",
            "error"]
# an embed job's (/v1/embeddings requests, batchgen.jobs.openai.embedding_output): no generated text
_EMBED_COLUMNS = [ID_COLUMN, "url", EMBEDDING, "num_prompt_tokens", "error"]
_LOGPROBS = "logprobs"  # batchgen.io.store.schema.LOGPROBS: absent in directories begun before it
_READ_BATCH_ROWS = 4096


def batch_dir_name(output_format: str) -> str:
    """Where the files go, relative to the output directory (see BATCH_BOTH_DIR)."""
    assert output_format in (OPENAI_BATCH, "both"), output_format
    return "." if output_format == OPENAI_BATCH else BATCH_BOTH_DIR


def write_batch_files(out: str | Path | OutputStore, state: ManifestState, dir_name: str, *,
                      created: int | None = None,
                      sources: list[tuple[str | Path | OutputStore, ManifestState]] | None = None) -> dict[str, Any]:
    """Write OUTPUT_FILE and ERRORS_FILE into `out/dir_name` (a local directory or an object-store
    prefix) from the committed parts (see the module docstring); return what `_SUCCESS` records
    about them. `created` (unix seconds, default the last commit's time) is kept by a rewrite of
    unchanged rows (compact).

    `sources` (a sharded job's shard directories and their states, in shard order; `batchgen
    finalize`) are read instead of `out`'s own parts: the job-level files then hold every
    shard's rows, in shard order, under the shards' common fingerprint (`state` is one of theirs)
    and the latest commit time of any shard."""
    store = open_store(out)
    readers = [(open_store(source), source_state) for source, source_state in (sources or [(store, state)])]
    fingerprint = state.fingerprint or {}
    digest = fingerprint_digest(fingerprint) if fingerprint else "0" * 16
    last_commit = max((s.last_commit_time or 0 for _, s in readers), default=0)
    context = {"model": str(fingerprint.get("model") or "batchgen"), "digest": digest,
               "created": created if created is not None else int(last_commit or time.time())}
    lines = (_line(rows, context) for source, source_state in readers
             for rows in _requests(_committed_rows(source, source_state)))
    target = batch_file_target(store) if dir_name == "." else None
    if target is not None:  # a .jsonl --output: every line in that one file (batchgen.jobs.openai.batch_file)
        return {"dir": dir_name, "file": target[1], "last_seq": state.last_seq, "created": context["created"],
                "files": {target[1]: write_batch_file(target, lines)}}
    if isinstance(store, LocalStore):
        counts = _write_local(store.path(dir_name), lines)
    else:
        counts = _write_objects(store, dir_name, lines)
    return {"dir": dir_name, "last_seq": state.last_seq, "created": context["created"],
            "files": {name: {"rows": n} for name, n in counts.items()}}


def ensure_batch_files(store: OutputStore, state: ManifestState, output_format: str, *,
                       failed: bool) -> dict[str, Any] | None:
    """At the end of a run that has every row: the Batch files written unless `_SUCCESS` says they
    hold exactly the committed rows; what `_SUCCESS` records of them. A job that failed
    --max-error-rate gets the pair written (no `_SUCCESS` vouches for it), but no single .jsonl
    file: that file's presence alone says the job completed."""
    dir_name = batch_dir_name(output_format)
    target = batch_file_target(store) if dir_name == "." else None
    if failed and target is not None:
        clear_batch_file(store)
        return None
    written = None if failed else batch_files_written(store, state, dir_name)
    if written is None:
        clear_success(store)  # no _SUCCESS beside files being replaced (the module docstring)
        written = write_batch_files(store, state, dir_name)
        where = target[0] / target[1] if target is not None else store / dir_name
        log.info("wrote the Batch API output in %s", where)
    return written


def _write_local(target: Path, lines: Iterator[tuple[bool, bytes]]) -> dict[str, int]:
    """Both files under hidden temp names, fsynced; the old pair removed; the new pair renamed in.

    The temp names are this writer's own, and held until renamed in (batchgen.jobs.openai.temp_files):
    two writers (a finalize and a compact that raced past their lock, or a lock-free filesystem)
    never open one file between them, so each renames in a whole file of its own, and the temps a
    killed writer left are deleted here. The caller holds the output's lock (finalize, compact, run)."""
    token = uuid.uuid4().hex[:8]
    temps = {name: target / f".{name}.{token}{TEMP_SUFFIX}" for name in (OUTPUT_FILE, ERRORS_FILE)}
    counts = {OUTPUT_FILE: 0, ERRORS_FILE: 0}
    try:
        if not target.is_dir():
            target.mkdir()
            fsync_dir(target.parent)
        sweep_dead_temps(target, (OUTPUT_FILE, ERRORS_FILE))
        with open_held(temps[OUTPUT_FILE]) as ok, open_held(temps[ERRORS_FILE]) as bad:
            for is_error, line in lines:
                (bad if is_error else ok).write(line)
                counts[ERRORS_FILE if is_error else OUTPUT_FILE] += 1
            for file in (ok, bad):
                file.flush()
                os.fsync(file.fileno())
            for name in (OUTPUT_FILE, ERRORS_FILE):  # the old pair goes before any of the new one shows
                (target / name).unlink(missing_ok=True)
            fsync_dir(target)
            for name, temp in temps.items():  # still held: no other writer takes them for a dead one's
                fault_point("batch_file_rename")
                os.replace(temp, target / name)
        fsync_dir(target)
    except OSError as e:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the Batch API output files in {target}: {e.strerror or e}") from e
    return counts


def _write_objects(store: OutputStore, dir_name: str, lines: Iterator[tuple[bool, bytes]]) -> dict[str, int]:
    """On an object store (no rename): the old pair deleted, then each new file streamed to its final
    name, visible when whole (ObjectStore.open_stream). As with local files, no _SUCCESS stands
    beside the pair meanwhile, and a listing never shows an old line beside a new one."""
    names = {name: name if dir_name == "." else f"{dir_name}/{name}" for name in (OUTPUT_FILE, ERRORS_FILE)}
    counts = {OUTPUT_FILE: 0, ERRORS_FILE: 0}
    try:
        for name in names.values():
            store.delete(name)
        with store.open_stream(names[OUTPUT_FILE]) as ok, store.open_stream(names[ERRORS_FILE]) as bad:
            for is_error, line in lines:
                (bad if is_error else ok).write(line)
                counts[ERRORS_FILE if is_error else OUTPUT_FILE] += 1
    except (OSError, OutputError) as e:
        raise OutputError(f"cannot write the Batch API output files in {store / dir_name}: {e}") from e
    return counts


def recorded_batch_files(out_dir: str | Path | OutputStore) -> dict[str, Any] | None:
    """What `_SUCCESS` records of the Batch files (None: it records none, or there is no `_SUCCESS`)."""
    try:
        written = json.loads(open_store(out_dir).read_bytes(SUCCESS_FILE).decode("utf-8")).get(SUCCESS_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return written if isinstance(written, dict) and isinstance(written.get("dir"), str) else None


def batch_files_written(out: str | Path | OutputStore, state: ManifestState, dir_name: str) -> dict[str, Any] | None:
    """What `_SUCCESS` records of the files, if they are in `dir_name` and were written from exactly
    the committed rows there are now; None when they must be written."""
    store = open_store(out)
    written = recorded_batch_files(store)
    target = batch_file_target(store) if dir_name == "." else None
    if written is None or written["dir"] != dir_name or written.get("last_seq") != state.last_seq:
        return None
    if target is not None:
        return written if written.get("file") == target[1] and batch_file_present(target) else None
    if all(store.exists(name if dir_name == "." else f"{dir_name}/{name}") for name in (OUTPUT_FILE, ERRORS_FILE)):
        return written
    return None


def _line(rows: list[dict[str, Any]], context: dict[str, Any]) -> tuple[bool, bytes]:
    """(is an error row, its line in UTF-8)."""
    line = output_line(rows, context)
    text = json.dumps(line, ensure_ascii=False) + "\n"
    return line["response"]["status_code"] != 200, text.encode("utf-8")


def _requests(rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Committed rows grouped by request: a request's samples 1..n-1 follow its sample 0."""
    group: list[dict[str, Any]] = []
    for row in rows:
        if group and row.get(SAMPLE_INDEX):  # a later sample of the same request
            assert row[ID_COLUMN] == group[0][ID_COLUMN] and row[SAMPLE_INDEX] == len(group), "samples out of order"
            group.append(row)
            continue
        if group:
            yield group
        group = [row]
    if group:
        yield group


def output_line(rows: dict[str, Any] | list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """One committed request (its row, or its samples' rows in order) as a Batch API output line."""
    rows = rows if isinstance(rows, list) else [rows]
    row = rows[0]
    custom_id = row[ID_COLUMN]
    key = hashlib.blake2b(f"{context['digest']}\x00{custom_id}".encode(), digest_size=16).hexdigest()
    request_id = f"req_{key}"
    embed = EMBEDDING in row  # an embed job's row: an error row has no embedding
    try:
        if row["error"] is not None if embed else row["finish_reason"] == "error":
            raise RequestRefused(*split_api_error(row["error"] or ""))
        body: dict[str, Any] = embeddings_body(rows, context) if embed else completion_body(rows, key, context)
        status = 200
    except RequestRefused as e:  # an error row, or a request its embeddings cannot answer
        body = {"error": {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": e.code}}
        status = 400
    return {"id": f"batch_req_{key}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def completion_body(rows: dict[str, Any] | list[dict[str, Any]], key: str, context: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion (chat requests) or text_completion object for a successful request: one
    choice per row (sample), index = its sample_index."""
    rows = rows if isinstance(rows, list) else [rows]
    prompt_tokens = int(rows[0]["num_prompt_tokens"])
    completion_tokens = sum(int(r["num_generated_tokens"]) for r in rows)
    common = {"created": context["created"], "model": context["model"],
              "system_fingerprint": f"fp_{context['digest'][:10]}",
              "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens}}
    if rows[0]["url"] == CHAT_URL:
        choices = [{"index": i, "message": {"role": "assistant", "content": r["generated_text"], "refusal": None},
                    "logprobs": None if r.get(_LOGPROBS) is None else chat_logprobs(r[_LOGPROBS]),
                    "finish_reason": r["finish_reason"]} for i, r in enumerate(rows)]
        return {"id": f"chatcmpl-{key}", "object": "chat.completion", "choices": choices, **common}
    choices = [{"index": i, "text": r["generated_text"],
                "logprobs": None if r.get(_LOGPROBS) is None else completion_logprobs(r[_LOGPROBS]),
                "finish_reason": r["finish_reason"]} for i, r in enumerate(rows)]
    return {"id": f"cmpl-{key}", "object": "text_completion", "choices": choices, **common}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def item(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

    return {"content": [{**item(e), "top_logprobs": [item(a) for a in e["top_logprobs"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A text_completion choice's `logprobs`: parallel lists, the alternatives as {token: logprob}."""
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _committed_rows(store: OutputStore, state: ManifestState) -> Iterator[dict[str, Any]]:
    """Every committed row, part by part in commit order, in bounded memory."""
    for name in state.parts:
        with store.open_input(name) as file:
            parquet = pq.ParquetFile(file)
            names = parquet.schema_arrow.names
            own = [*_EMBED_COLUMNS, BODY_COLUMN] if EMBEDDING in names else [*_COLUMNS, _LOGPROBS]
            columns = [*own[:-1], *(c for c in (own[-1], SAMPLE_INDEX) if c in names)]
            for batch in parquet.iter_batches(batch_size=_READ_BATCH_ROWS, columns=columns):
                yield from batch.to_pylist()
