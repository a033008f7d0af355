"""One run's hold on its output directory: lock, crash recovery, fingerprint check, begin, release.

`OutputSession.open` creates and locks the directory and finishes (or undoes) what a crashed run
left there; `check_fingerprint` refuses a different config over committed rows, `check_inputs`
changed inputs under derived ids (batchgen.jobs.durability.identity); `start` writes the "begin" and
"inputs" manifest entries; `close` releases the lock, and removes the directories this run
created if it wrote nothing.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

from batchgen.errors import FingerprintMismatch, OutputError
from batchgen.io.manifest.manifest import (
    MANIFEST_DIR,
    PART_NAME_RE,
    SUCCESS_FILE,
    Manifest,
    clear_success,
    is_job_dir,
    load_manifest,
)
from batchgen.io.manifest.partials import clean_partial_files
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_FILE
from batchgen.io.store.lock import LOCK_FILE
from batchgen.io.store.schema import JSON_VALID, LOGPROBS, PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import check_output_dir
from batchgen.jobs.durability.fingerprint import fingerprint_changes
from batchgen.jobs.durability.identity import check_derived_ids, check_sharded_retry, orphans
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.openai.output import BATCH_BOTH_DIR, BATCH_FILES

log = logging.getLogger("batchgen")

SUMMARY_FILE = "_summary.json"


class OutputSession:
    """One run's hold on its output directory; see the module docstring."""

    def __init__(self, out_dir: str | Path | OutputStore, *, overwrite: bool = False, keep_hashes: bool = False):
        self.store = open_store(out_dir)  # a local directory, or an object-store prefix (s3://, gs://)
        # a local Path where there is one, else the store (its str is the URL)
        self.out_dir = self.store.path() if isinstance(self.store, LocalStore) else self.store
        self.overwrite = overwrite
        self.keep_hashes = keep_hashes  # hold committed rows' prompt hashes (--id-column resumes)
        self.created: list[Path] = []  # directories this run created, innermost first
        self.started = False  # a "begin" or "inputs" entry was written by this run
        self.lock = self.store.lock()  # an flock'ed file, or a lease object (batchgen.io.store.lease)
        self.manifest: Manifest | None = None
        # the model's identity before it loads (batchgen.engine.model.model_files), recorded with the inputs
        # a run generates from, so that a later rerun can tell the same model without loading it
        self.model_files: dict[str, Any] | None = None

    @property
    def state(self):
        assert self.manifest is not None
        return self.manifest.state

    def open(self) -> None:
        """Create (if need be) and lock the directory, then recover what a crash left."""
        if isinstance(self.store, LocalStore):
            path = self.store.path().absolute()
            while not path.exists() and path != path.parent:
                self.created.append(path)  # innermost first
                path = path.parent
        check_output_dir(self.store)
        self.lock.acquire()
        self._refuse_foreign_files()
        self.manifest = Manifest(self.store, load_manifest(self.store, keep_hashes=self.keep_hashes),
                                 guard=self.lock)
        damaged = self.manifest.recover()
        if damaged:
            for record in damaged:
                log.warning("committed part %s is missing or damaged; its %d rows will be generated again",
                            record.name, record.num_rows)
            self.manifest.commit([], [r.name for r in damaged], op="repair")
        self.manifest.drop_history()  # what a crash left of a snapshot's clean-up
        partials = self.state.partials
        clean_partial_files(self.store, keep=partials["file"] if partials else None)  # uncommitted ones
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

    def writes_prompt_hash(self) -> bool:
        """Whether this run's parts carry the prompt_hash column: yes, unless it resumes rows
        committed by a batchgen from before the column (their parts must stay one table)."""
        return self._writes_column(PROMPT_HASH)

    def writes_prompt_truncated(self) -> bool:
        """The same for the prompt_truncated column."""
        return self._writes_column(PROMPT_TRUNCATED)

    def writes_logprobs(self) -> bool:
        """The same for the logprobs column of an OpenAI Batch job (written for requests that ask)."""
        return self._writes_column(LOGPROBS)

    def writes_json_valid(self) -> bool:
        """The same for the json_valid column of an OpenAI Batch job (a JSON response_format's rows)."""
        return self._writes_column(JSON_VALID)

    def writes_sample_index(self) -> bool:
        """The same for the sample_index column of a job whose rows may ask for n (a --sampling-column,
        OpenAI Batch requests): a directory begun before it keeps one row per input row."""
        return self._writes_column(SAMPLE_INDEX)

    def _writes_column(self, column: str) -> bool:
        old = self.state.fingerprint
        if old is None or self.overwrite or not self.state.num_committed_rows:
            return True
        return any(name == column for name, _ in old.get("output_schema", []))

    def check_inputs(self, scan: InputScan, *, id_column: str | None) -> None:
        """Refuse inputs that differ from the committed rows' (exit 2) unless --overwrite: under
        derived ids, and in a shard of a sharded job under --id-column."""
        if self.overwrite:
            return
        if id_column is None:
            old = self.state.inputs["inputs"] if self.state.inputs else None
            check_derived_ids(str(self.out_dir), self.state.num_committed_rows, old, scan.to_json())
        else:  # a shard of a sharded job: its rows follow the inputs (batchgen.jobs.rows.split)
            check_sharded_retry(str(self.out_dir), self.state.num_committed_rows, self.state.inputs, scan.to_json(),
                                scan.split)

    def start(self, fingerprint: dict[str, Any], scan: InputScan, max_rows: int | None) -> None:
        """Begin the job (first run, --overwrite, or nothing committed under another config),
        and record this run's inputs for `batchgen status`."""
        self.check_fingerprint(fingerprint)
        manifest = self.manifest
        old = self.state.fingerprint
        began = old is None or self.overwrite or bool(fingerprint_changes(old, fingerprint))
        if began:
            had_rows = bool(self.state.parts)
            if had_rows:
                log.warning("--overwrite: dropping %d committed rows in %s", self.state.num_committed_rows,
                            self.out_dir)
            clear_success(self.store)
            self.store.delete(SUMMARY_FILE)
            for directory in ("", f"{BATCH_BOTH_DIR}/"):  # an earlier job's Batch files
                for name in BATCH_FILES:
                    self.store.delete(f"{directory}{name}")
            manifest.begin(fingerprint)  # the commit point: from here no earlier part counts
            self.started = True
            if had_rows:
                manifest.recover()  # deletes the parts the "begin" dropped
            manifest.drop_history()
            clean_partial_files(self.store, keep=None)  # the "begin" dropped them
        self.record_inputs(scan, max_rows, began=began)

    def record_inputs(self, scan: InputScan, max_rows: int | None, *, began: bool = False) -> None:
        """Record this run's inputs (and under --id-column the committed ids gone from them) for
        `batchgen status`; also a rerun with nothing to do, whose inputs may differ from the last."""
        manifest = self.manifest
        inputs = scan.to_json()
        payload: dict[str, Any] = {"inputs": inputs, "max_rows": max_rows}
        if scan.split is not None:  # a shard of a sharded job (batchgen.jobs.rows.split)
            payload["split"] = scan.split
        if self.model_files is not None:
            payload["model_files"] = self.model_files
        if scan.ids is not None and max_rows is None:  # --id-column: committed ids gone from the input
            state = self.state
            payload["orphans"] = orphans(itertools.chain(state.ok_ids, state.error_ids), scan.ids)
            scan.ids = None  # compared: the set is not needed again
        # after a "begin" the earlier "inputs" entry is history (drop_history deleted it), though the
        # in-memory state still holds it: write the inputs again, or a reload would find none
        last = None if began else self.state.inputs
        if last is None or any(last.get(key) != value for key, value in payload.items()):
            manifest.append("inputs", **payload)
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

    def foreign_names(self) -> list[str]:
        """What a directory that is not (yet) a batchgen job holds besides our lock and the hidden
        temp files of a run killed before its first commit (recovery deletes those). Read-only."""
        if is_job_dir(self.store) and not self._manifest_is_link():
            return []
        return sorted(name + ("/" if size is None else "") for name, size in self.store.list().items()
                      if name not in (LOCK_FILE, LEASE_FILE) and not (name.startswith(".") and name.endswith(".tmp")))

    def _manifest_is_link(self) -> bool:
        return isinstance(self.store, LocalStore) and self.store.path(MANIFEST_DIR).is_symlink()

    def _refuse_foreign_files(self) -> None:
        """A directory that holds no batchgen job must be empty: parts written beside other files
        are read with them (`pyarrow.dataset` over the directory returns both, mixed schemas and all)."""
        if self._manifest_is_link():
            raise OutputError(f"{self.out_dir} has a symbolic link for its {MANIFEST_DIR}/ directory, which "
                              "batchgen never writes: the job's commit log would be kept, and its entries "
                              "deleted, wherever it points; remove the link or choose a new --output directory")
        if is_job_dir(self.store):
            return
        names = self.foreign_names()
        if not names:
            return
        # parts and files of a batchgen older than the manifest: replaced with --overwrite
        ours = [n for n in names if PART_NAME_RE.fullmatch(n) or n in (SUCCESS_FILE, SUMMARY_FILE)]
        if self.overwrite and len(ours) == len(names):
            for name in ours:
                self.store.delete(name)
            self.store.sync()
            return
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        if any(n.endswith(".parquet") for n in names) and len(ours) == len(names):
            raise OutputError(f"{self.out_dir} already holds output parts that no batchgen manifest lists ({shown}); "
                              "pass --overwrite to replace them, or choose a new --output directory")
        parquet = any(n.endswith(".parquet") for n in names)
        unlisted = ", Parquet files that no batchgen manifest lists" if parquet else ""
        raise OutputError(f"{self.out_dir} is not empty and is not a batchgen job's output directory (it holds "
                          f"{shown}{unlisted}); choose a new or empty --output directory, e.g. {self.store / 'job'}")
