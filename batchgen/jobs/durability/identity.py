"""Input identity: what the manifest records about each input file, and what a resume compares.

Every run records, per input file, its path and what identifies its content: size, modification
time (where the filesystem gives one), the Parquet footer's row count, a digest of the file's
schema, and a digest of the bytes ("inputs" manifest entry). The bytes digest is a sha256 of the
whole file up to CONTENT_DIGEST_MAX_BYTES, and of a larger Parquet file's footer (its row groups'
offsets, sizes and column statistics: an edit that leaves those alike is missed); a larger JSON
Lines file has none, and only its size and modification time tell. So a same-size edit whose
modification time was kept (`cp -p`, `rsync -a`) is seen in small files and in most Parquet ones;
a resume names the files it could compare only in part (a log line: no refusal, nothing changed).
A resume compares them with the files it is given:

- Derived ids ("<file name>:<row index>") name a row by its place in a file, so any change to the
  set of files or to a file's identity would silently pair committed outputs with other prompts
  (rows inserted before a resume) or skip new rows (another day's file of the same name). With
  rows committed, such a resume is refused (exit 2) naming each file and what changed; the ways
  out are --overwrite, a new --output, or an --id-column.
- A shard of a sharded job (--num-shards) records only the files it reads, each with the row
  range it reads ("rows"): its check covers its share, and a changed split is a change.
- With --id-column, files and rows may come and go between runs (incremental backfills), except
  in a sharded job, where the split follows the inputs: a shard's retry over changed inputs is
  refused (`check_sharded_retry`), as the rows would move between shards. Otherwise the
  row's own id and its prompt hash decide (batchgen.jobs.durability.resume), and committed ids that no longer
  appear in the input are counted ("orphans") for `batchgen status`, never deleted.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pyarrow as pa

from batchgen.errors import InputError, InputsChanged
from batchgen.io.inputs.discovery import InputFile, filesystem

log = logging.getLogger("batchgen")

# the fields of an identity, with how a change is described
_FIELDS = (("num_rows", "rows"), ("size", "bytes"), ("schema", "schema"), ("mtime_ns", "modified"),
           ("rows", "row range"), ("digest", "content"))
# fields a batchgen before them did not record: compared only where both identities have them
_ADDED_FIELDS = ("digest",)
# files up to this size are hashed whole; a larger Parquet file by its footer alone. Small on
# purpose: every shard of a sharded job identifies every file of the job (batchgen.jobs.durability.scan)
CONTENT_DIGEST_MAX_BYTES = 4 << 20
_READ_BYTES = 1 << 20


def file_identity(file: InputFile, schema: pa.Schema) -> dict[str, Any]:
    """What identifies the file's content, cheaply: no row is read."""
    text = schema.remove_metadata().to_string(show_field_metadata=False)
    identity: dict[str, Any] = {"size": file.size, "mtime_ns": file.mtime_ns,
                                "schema": hashlib.sha256(text.encode()).hexdigest()[:16]}
    if file.num_rows is not None:
        identity["num_rows"] = file.num_rows  # the Parquet footer's count (JSONL: unknown unread)
    digest = content_digest(file)
    if digest is not None:
        identity["digest"] = digest
    if file.rows is not None:
        # a sharded job's share of the file (batchgen.jobs.rows.split): another split (other files, another
        # --num-shards) moves rows between shards, which a resume of this shard must not miss
        identity["rows"] = list(file.rows)
    return identity


def content_digest(file: InputFile) -> str | None:
    """"sha256:<hex16>" of the whole file (up to CONTENT_DIGEST_MAX_BYTES), "footer:<hex16>" of a
    larger Parquet file's footer, None for a larger JSON Lines file (see the module docstring)."""
    fs, fs_path = filesystem(file.path)
    h = hashlib.sha256()
    try:
        with fs.open_input_file(fs_path) as f:
            size = f.size()
            if size <= CONTENT_DIGEST_MAX_BYTES:
                while chunk := f.read(_READ_BYTES):
                    h.update(chunk)
                return f"sha256:{h.hexdigest()[:16]}"
            if file.format != "parquet":
                return None
            f.seek(size - 8)  # the footer's length (4 bytes, little-endian), then "PAR1"
            footer_length = int.from_bytes(f.read(4), "little")
            f.seek(max(0, size - 8 - footer_length))
            h.update(f.read(footer_length))
            return f"footer:{h.hexdigest()[:16]}"
    except OSError as e:
        raise InputError(f"cannot read the file to identify it: {e}", path=file.path) from e


def input_changes(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """'path: what changed' for each file added, removed or changed between two "inputs" lists.

    A file recorded without an identity (by a batchgen before identities) is compared by path only.
    """
    old_by_path = {i["path"]: i for i in old}
    new_by_path = {i["path"]: i for i in new}
    changes = [f"{path}: no longer an input" for path in old_by_path if path not in new_by_path]
    changes += [f"{path}: a new input" for path in new_by_path if path not in old_by_path]
    for path, now in new_by_path.items():
        before = old_by_path.get(path, {}).get("identity")
        if before is None or now.get("identity") is None:
            continue
        what = [_describe(key, label, before.get(key), now["identity"].get(key)) for key, label in _FIELDS
                if before.get(key) != now["identity"].get(key)
                and (key not in _ADDED_FIELDS or (key in before and key in now["identity"]))]
        if what:
            changes.append(f"{path}: {', '.join(what)}")
    return changes


def _describe(key: str, label: str, before: Any, now: Any) -> str:
    if key == "mtime_ns":
        return "modified since"
    if key == "digest":
        return "content changed"
    if key == "schema":
        return "columns or types changed"
    if key == "rows":
        return f"this shard's rows {_range(before)} -> {_range(now)} (the split changed)"
    return f"{before} -> {now} {label}"


def _range(rows: list[int] | None) -> str:
    return "all" if rows is None else f"[{rows[0]}, {rows[1]})"


def check_derived_ids(out_dir: str, num_committed_rows: int, old: list[dict[str, Any]] | None,
                      new: list[dict[str, Any]]) -> None:
    """Refuse (InputsChanged, exit 2) a resume whose inputs differ from the committed rows' inputs
    when ids are derived from file names and row indices."""
    if not num_committed_rows or old is None:
        return
    changes = input_changes(old, new)
    if not changes:
        _say_what_identity_covers(new)
        return
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    raise InputsChanged(
        f"{out_dir} holds {num_committed_rows} rows committed from other inputs, and their ids are derived from "
        f"file name and row index, so they would be paired with other rows: {shown}. Rerun with the original "
        "inputs, pass --overwrite to start over, choose a new --output, or give rows stable ids with --id-column")


def _say_what_identity_covers(inputs: list[dict[str, Any]]) -> None:
    """A resume that passed the check says which files it could compare only in part: an edit in
    place that keeps what it compared pairs committed outputs with rows that changed, unseen."""
    partial = [i["path"] for i in inputs if i.get("identity") is not None
               and not str(i["identity"].get("digest", "")).startswith("sha256:")]
    if not partial:
        return
    shown = ", ".join(partial[:3]) + (f" and {len(partial) - 3} more" if len(partial) > 3 else "")
    log.info("resuming over %d input %s larger than %d MiB (%s), identified by size, modification time, "
             "row count, schema and (Parquet) footer, not by every byte: an edit in place that keeps all of "
             "those is not seen; give rows ids of their own with --id-column if inputs are edited in place",
             len(partial), "file" if len(partial) == 1 else "files", CONTENT_DIGEST_MAX_BYTES >> 20, shown)


def check_sharded_retry(out_dir: str, num_committed_rows: int, old: dict[str, Any] | None,
                        new: list[dict[str, Any]], split: dict[str, Any] | None) -> None:
    """--id-column in a sharded job: refuse (InputsChanged, exit 2) a shard's retry over inputs other
    than its committed rows' (another file set or a changed file anywhere in the job moves the
    split). Its rows would move between shards: ids committed here would be generated again by
    another shard, and rows that moved here would be missed by the shard they left."""
    if not num_committed_rows or old is None or split is None:
        return
    before = (old.get("split") or {}).get("job_inputs")
    if before is None or before == split["job_inputs"]:
        return
    changes = input_changes(old["inputs"], new) or [
        f"files of other shards changed (the job's inputs digest {before} -> {split['job_inputs']})"]
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    raise InputsChanged(
        f"{out_dir} holds {num_committed_rows} rows of shard {split['shard_index']} of {split['num_shards']}, "
        f"committed from other inputs, and the split follows the inputs, so rows would move between shards: "
        f"{shown}. Rerun with the original inputs, or rerun every shard with --overwrite over the new ones")


def orphans(committed: Any, input_ids: set[Any], *, num_examples: int = 5) -> dict[str, Any]:
    """Committed ids (an iterable) that no longer appear in the input: how many, and a few of them."""
    missing = [row_id for row_id in committed if row_id not in input_ids]
    missing.sort(key=repr)
    return {"num_rows": len(missing), "examples": missing[:num_examples]}
