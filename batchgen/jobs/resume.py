"""What a run must do given what earlier runs committed: scan, fingerprint, open, commit.

- `scan_inputs`: one pass over the id column before any output: row counts per shard (status,
  progress, _SUCCESS) and duplicate or null ids, reported with file, row and column.
- `job_fingerprint`: every setting that changes what a row's output is. A run whose fingerprint
  differs from the one the output directory was begun with is refused (exit 2, naming what
  changed) unless --overwrite; with no committed rows yet there is nothing to protect and the
  new run simply begins again.
- `OutputSession`: the locked output directory for one run: recovery after a crash, the
  fingerprint check, the "begin" and "inputs" manifest entries, and the lock's release.
- `Committer`: buffers finished rows and commits them, at most rows_per_part rows per part. A
  retried error row that now succeeds, or fails differently, replaces its old row in the same
  commit: the part that held it is rewritten without it (or removed when nothing is left). One
  that fails again with the same message keeps its committed row and costs no write (today's
  error rows are all of that kind: a prompt that cannot be built fails the same way every time).
  Either way each id is in exactly one part.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen import __version__
from batchgen.config import JobConfig
from batchgen.errors import FingerprintMismatch, InputError, OutputError
from batchgen.io.lock import OutputLock
from batchgen.io.manifest import (
    PART_NAME_RE,
    SUCCESS_FILE,
    Manifest,
    PartRecord,
    clear_success,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    part_rows,
)
from batchgen.io.readers import iter_batches
from batchgen.io.writers import PartWriter, check_output_dir, fsync_dir
from batchgen.jobs.rows import RowSource

log = logging.getLogger("batchgen")

SUMMARY_FILE = "_summary.json"
# Set after the model is loaded; compared only then. The dtype is the resolved one ("auto" may
# mean bfloat16 on one machine and float32 on another): greedy outputs differ between them.
MODEL_KEYS = ("model_revision", "dtype", "chat", "max_context_tokens")
# Shown but never compared: the same model may be named by another path on a resume.
INFO_KEYS = ("model",)


# ---------------------------------------------------------------- the input scan


@dataclass(slots=True)
class InputScan:
    shard_rows: list[tuple[str, int]]  # (shard path, rows this run reads from it), input order

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.shard_rows)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"path": path, "num_rows": n} for path, n in self.shard_rows]


def scan_inputs(source: RowSource) -> InputScan:
    """Count rows per shard and check ids, reading only the id column; --max-rows applies.

    Parquet shards with derived ids need no read at all (the footer has the count, and
    "<file>:<row>" ids are unique by construction).
    """
    config = source.config
    id_column = config.id_column
    if id_column:
        id_type = source.id_field.type
        if not (pa.types.is_integer(id_type) or pa.types.is_string(id_type) or pa.types.is_large_string(id_type)):
            raise InputError(f"--id-column {id_column!r} holds {id_type}; ids must be integers or strings",
                             column=id_column)
    remaining = config.max_rows
    seen: set[Any] = set()
    shard_rows = []
    for shard in source.shards:
        if remaining is not None and remaining <= 0:
            shard_rows.append((shard.path, 0))
            continue
        if shard.num_rows is not None and not id_column:
            n = shard.num_rows if remaining is None else min(shard.num_rows, remaining)
        else:
            column = id_column or source.read_columns[0]
            n = 0
            for batch in iter_batches(shard, [column], config.read_batch_size):
                values = batch.column(0).to_pylist() if id_column else [None] * batch.num_rows
                if remaining is not None:
                    values = values[: remaining - n]
                if id_column:
                    for i, row_id in enumerate(values):
                        _check_id(source, seen, row_id, shard.path, n + i)
                n += len(values)
                if remaining is not None and n >= remaining:
                    break
        shard_rows.append((shard.path, n))
        if remaining is not None:
            remaining -= n
    return InputScan(shard_rows)


def _check_id(source: RowSource, seen: set[Any], row_id: Any, path: str, row: int) -> None:
    column = source.config.id_column
    if row_id is None:
        raise InputError("id is null; every row needs an id", path=path, row=row, column=column)
    if row_id in seen:
        first = _first_occurrence(source, row_id)
        raise InputError(f"duplicate id {row_id!r} (first at {first}); ids must be unique, because "
                         "the output is keyed by them", path=path, row=row, column=column)
    seen.add(row_id)


def _first_occurrence(source: RowSource, row_id: Any) -> str:
    for shard in source.shards:  # only on the error path: a second read is cheaper than a map
        n = 0
        for batch in iter_batches(shard, [source.config.id_column], source.config.read_batch_size):
            values = batch.column(0).to_pylist()
            if row_id in values:
                return f"{shard.path}, row {n + values.index(row_id)}"
            n += len(values)
    return "?"


# ---------------------------------------------------------------- the config fingerprint


def job_fingerprint(config: JobConfig, source: RowSource, schema: pa.Schema, *, model: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Settings that decide a row's output. `model` (from the loaded model and the prompt
    builder: MODEL_KEYS plus "model") is left out for the check made before loading."""
    fingerprint = {
        "batchgen_version": __version__,
        "model": config.model,
        "prompt_column": config.prompt_column, "template": config.template, "system": config.system,
        "id_column": config.id_column, "max_new_tokens": config.max_new_tokens,
        "max_new_tokens_column": config.max_new_tokens_column, "temperature": config.temperature,
        "top_p": config.top_p, "top_k": config.top_k, "seed": config.seed, "stop": list(config.stop),
        "ignore_eos": config.ignore_eos, "on_long_prompt": config.on_long_prompt,
        "max_prompt_tokens": config.max_prompt_tokens,
        "output_schema": [[f.name, str(f.type)] for f in schema],
    }
    # only when set, so fingerprints of jobs begun before these options existed still match
    quantization = {"quantize": config.quantize, "quantize_backend": config.quantize_backend,
                    "kv_cache_dtype": config.kv_cache_dtype}
    if quantization != {"quantize": "none", "quantize_backend": "auto", "kv_cache_dtype": "auto"}:
        fingerprint.update(quantization)
    if model is not None:
        assert set(model) == {"model", *MODEL_KEYS}, sorted(model)
        fingerprint.update(model)
    return fingerprint


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key old -> new' for each compared key that differs. Only the keys of `new` are compared,
    so a fingerprint made before the model is loaded checks everything but MODEL_KEYS."""
    changes = []
    for key in new:
        if key in INFO_KEYS:
            continue
        if old.get(key) != new[key]:
            changes.append(f"{key} {_short(old.get(key))} -> {_short(new[key])}")
    return changes


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- the output directory


class OutputSession:
    """One run's hold on its output directory; see the module docstring."""

    def __init__(self, out_dir: str | Path, *, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        self.overwrite = overwrite
        self.created: list[Path] = []  # directories this run created, innermost first
        self.started = False  # a "begin" or "inputs" entry was written by this run
        self.lock = OutputLock(self.out_dir)
        self.manifest: Manifest | None = None

    @property
    def state(self):
        assert self.manifest is not None
        return self.manifest.state

    def open(self) -> None:
        """Create (if need be) and lock the directory, then recover what a crash left."""
        path = self.out_dir.absolute()
        while not path.exists() and path != path.parent:
            self.created.append(path)  # innermost first
            path = path.parent
        check_output_dir(self.out_dir)
        self.lock.acquire()
        self._refuse_foreign_files()
        self.manifest = Manifest(self.out_dir, load_manifest(self.out_dir))
        damaged = self.manifest.recover()
        if damaged:
            for record in damaged:
                log.warning("committed part %s is missing or damaged; its %d rows will be generated again",
                            record.name, record.num_rows)
            self.manifest.commit([], [r.name for r in damaged], op="repair")
        self.state.check_integrity()

    def check_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        """Refuse a different config over committed rows (exit 2) unless --overwrite."""
        old = self.state.fingerprint
        if old is None or self.overwrite or not self.state.num_committed_rows:
            return
        changes = fingerprint_changes(old, fingerprint)
        if changes:
            raise FingerprintMismatch(
                f"{self.out_dir} holds {self.state.num_committed_rows} rows committed with other settings: "
                f"{'; '.join(changes)}. Rerun with the original settings to resume, pass --overwrite "
                "to start over, or choose a new --output")

    def start(self, fingerprint: dict[str, Any], scan: InputScan, max_rows: int | None) -> None:
        """Begin the job (first run, --overwrite, or nothing committed under another config),
        and record this run's inputs for `batchgen status`."""
        self.check_fingerprint(fingerprint)
        manifest = self.manifest
        old = self.state.fingerprint
        if old is None or self.overwrite or fingerprint_changes(old, fingerprint):
            had_rows = bool(self.state.parts)
            if had_rows:
                log.warning("--overwrite: dropping %d committed rows in %s", self.state.num_committed_rows,
                            self.out_dir)
            clear_success(self.out_dir)
            (self.out_dir / SUMMARY_FILE).unlink(missing_ok=True)
            manifest.begin(fingerprint)  # the commit point: from here no earlier part counts
            self.started = True
            if had_rows:
                manifest.recover()  # deletes the parts the "begin" dropped
            manifest.drop_history()
        inputs = scan.to_json()
        last = self.state.inputs
        if last is None or last.get("inputs") != inputs or last.get("max_rows") != max_rows:
            manifest.append("inputs", inputs=inputs, max_rows=max_rows)
            self.started = True

    def close(self) -> None:
        """Release the lock; a run that failed before it wrote anything leaves no directory behind."""
        self.lock.release()
        if not self.started:
            for path in self.created:
                try:
                    path.rmdir()  # only if empty
                except OSError:
                    break

    def _refuse_foreign_files(self) -> None:
        """Parquet files no manifest speaks for would be read with ours: refuse them."""
        if is_job_dir(self.out_dir):
            return
        names = sorted(p.name for p in self.out_dir.iterdir() if p.suffix == ".parquet"
                       and not p.name.startswith((".", "_")))
        if not names:
            return
        ours = [n for n in names if PART_NAME_RE.fullmatch(n)]
        if self.overwrite and len(ours) == len(names):
            for name in ours:
                (self.out_dir / name).unlink()
            for name in (SUCCESS_FILE, SUMMARY_FILE):
                (self.out_dir / name).unlink(missing_ok=True)
            fsync_dir(self.out_dir)
            return
        hint = "pass --overwrite to replace them, or " if len(ours) == len(names) else ""
        raise OutputError(f"{self.out_dir} already holds output parts that no batchgen manifest lists "
                          f"({names[0]}{', ...' if len(names) > 1 else ''}); {hint}choose a new --output directory")


# ---------------------------------------------------------------- committing rows


@dataclass(slots=True)
class CommitCounts:
    num_commits: int = 0
    num_parts_written: int = 0
    num_rows_committed: int = 0
    num_rows_replaced: int = 0  # retried rows whose old error row was replaced
    num_rows_unchanged: int = 0  # retried rows that failed again the same way (nothing written)


@dataclass(slots=True)
class _Pending:
    out: dict[str, Any]
    shard: str
    row: int


class Committer:
    """Buffers finished output rows and commits them through the manifest."""

    def __init__(self, manifest: Manifest, writer: PartWriter, id_name: str, *, rows_per_part: int):
        self.manifest = manifest
        self.writer = writer
        self.id_name = id_name
        self.rows_per_part = rows_per_part
        self.buffer: list[_Pending] = []
        self.counts = CommitCounts()
        self._old_errors: dict[str, dict[Any, str]] = {}  # part -> {id: message of an error row}, lazily

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, out: dict[str, Any], shard: str, row: int) -> None:
        self.buffer.append(_Pending(out, shard, row))

    def commit(self) -> None:
        """Stage, commit and publish the buffer (one manifest entry); a no-op when empty."""
        if not self.buffer:
            return
        state = self.manifest.state
        seq_tag = f".{state.last_seq + 1:08d}"
        superseded: dict[str, set[Any]] = defaultdict(set)
        rows = []
        for item in self.buffer:
            row_id = item.out[self.id_name]
            old_part = state.error_ids.get(row_id)
            if old_part is not None:
                if item.out["error"] is not None and item.out["error"] == self._old_message(old_part, row_id):
                    self.counts.num_rows_unchanged += 1  # the committed row already says this
                    continue
                superseded[old_part].add(row_id)
            rows.append(item)
        staged: list = []
        remove: list[str] = []
        try:
            for start in range(0, len(rows), self.rows_per_part):
                chunk = rows[start:start + self.rows_per_part]
                part = self.writer.stage_part([p.out for p in chunk], tag=seq_tag)
                staged.append((part, PartRecord.staged(
                    part, [p.out[self.id_name] for p in chunk], [p.out["error"] is not None for p in chunk],
                    [p.shard for p in chunk], [p.row for p in chunk])))
            for name, ids in superseded.items():
                rewrite = self._rewrite_without(name, ids, seq_tag)
                if rewrite is None:
                    remove.append(name)
                else:
                    staged.append(rewrite)
        except BaseException:
            for part, _ in staged:  # nothing is committed yet: these temps are garbage
                part.temp_path.unlink(missing_ok=True)
            raise
        self.manifest.commit(staged, remove)  # a no-op when every row was an unchanged retry
        for name in superseded:
            self._old_errors.pop(name, None)
        self.counts.num_commits += bool(staged or remove)
        self.counts.num_parts_written += len(staged)
        self.counts.num_rows_committed += len(rows)
        self.counts.num_rows_replaced += sum(len(ids) for ids in superseded.values())
        self.buffer = []

    def _old_message(self, part_name: str, row_id: Any) -> str | None:
        if part_name not in self._old_errors:
            table = pq.read_table(self.manifest.out_dir / part_name, columns=[self.id_name, "error"])
            self._old_errors[part_name] = {
                i: m for i, m in zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True)
                if m is not None}
        return self._old_errors[part_name].get(row_id)

    def _rewrite_without(self, name: str, ids: set[Any], seq_tag: str):
        """Stage part `name` minus `ids` under its own name; None when nothing would be left."""
        record = self.manifest.state.parts[name]
        if len(ids) == record.num_rows:
            return None
        table = pq.read_table(self.manifest.out_dir / name)
        id_type = table.schema.field(self.id_name).type
        kept = table.filter(pc.invert(pc.is_in(table.column(self.id_name), value_set=pa.array(list(ids), id_type))))
        kept_ids = kept.column(self.id_name).to_pylist()
        shards, rows = part_rows(self.manifest.out_dir, record)
        position = {row_id: i for i, row_id in enumerate(record.ids)}
        part = self.writer.stage_part(kept, name=name, tag=seq_tag)
        return part, PartRecord.staged(part, kept_ids, [e is not None for e in kept.column("error").to_pylist()],
                                       [shards[position[i]] for i in kept_ids],
                                       [rows[position[i]] for i in kept_ids])


def fingerprint_summary(fingerprint: dict[str, Any] | None) -> dict[str, Any] | None:
    if fingerprint is None:
        return None
    return {"digest": fingerprint_digest(fingerprint), **fingerprint}

