"""Partial checkpoints: the generations of rows still in flight, committed so a resume continues them.

When a job stops (a signal, an engine failure, or every --checkpoint-in-flight-every seconds) it
writes, for every row that had generated tokens but not finished:

    _manifest/NNNNNNNN.partials.json   {"fingerprint": digest, "rows": [{"id", "prompt_hash",
                                       "token_ids": [...], "rng_state": base64 or null,
                                       "sample": its index, for samples 1..n-1 of a row}]}
                                       (temp + fsync + rename + directory fsync)
    _manifest/NNNNNNNN.json            {"op": "partials", "file", "fingerprint", "num_rows",
                                       "num_tokens", "num_bytes", "sha256"}: the commit point

The latest "partials" entry is the whole set (the job merges what it still holds from earlier
attempts), so an older file is dead once a newer entry is durable and is deleted then. A partial
is never an output row: it lives only in `_manifest/`, which no reader of the parts looks at.
A "begin" entry (a new job, --overwrite) drops it; a snapshot carries it over. A partial file
that is missing or does not match its entry is ignored with a warning: losing a partial only
costs regenerating the row, never correctness.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.io.manifest.manifest import MANIFEST_DIR, Manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore
from batchgen.io.store.writers import json_bytes

log = logging.getLogger(__name__)

PARTIALS_SUFFIX = ".partials.json"


@dataclass(frozen=True, slots=True)
class PartialRow:
    row_id: Any
    prompt_hash: str | None  # of the prompt the tokens continue: a changed prompt makes them useless
    token_ids: tuple[int, ...]  # generated so far
    # None since the counter-based stream (a row's tokens are its whole state); still read in older files
    rng_state: bytes | None
    sample_index: int = 0  # which of the row's samples (n > 1); "sample" in the file only when not 0

    @property
    def key(self) -> tuple[Any, int]:
        return self.row_id, self.sample_index

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.row_id, "prompt_hash": self.prompt_hash, "token_ids": list(self.token_ids),
               "rng_state": None if self.rng_state is None else base64.b64encode(self.rng_state).decode()}
        if self.sample_index:
            out["sample"] = self.sample_index
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartialRow:
        state = d["rng_state"]
        return cls(d["id"], d["prompt_hash"], tuple(d["token_ids"]),
                   None if state is None else base64.b64decode(state), d.get("sample", 0))


def write_partials(manifest: Manifest, rows: list[PartialRow], fingerprint: str) -> None:
    """Commit `rows` as the whole set of partial checkpoints (an empty list drops them all)."""
    store = manifest.store
    name = f"{manifest.state.last_seq + 1:08d}{PARTIALS_SUFFIX}"
    path = f"{MANIFEST_DIR}/{name}"
    assert manifest.state.last_seq, "partials are written after the job's begin entry"
    store.write_bytes(path, json_bytes({"fingerprint": fingerprint, "rows": [r.to_json() for r in rows]}))
    num_bytes, sha256 = store.digest(path)
    manifest.append("partials", file=name, fingerprint=fingerprint, num_rows=len(rows),
                    num_tokens=sum(len(r.token_ids) for r in rows), num_bytes=num_bytes, sha256=sha256)
    clean_partial_files(store, keep=name)


def read_partials(out_dir: Path | OutputStore, entry: dict[str, Any] | None,
                  fingerprint: str) -> dict[tuple[Any, int], PartialRow]:
    """The committed partials by (row id, sample index); empty when there are none or they belong to
    another config."""
    if entry is None or not entry["num_rows"]:
        return {}
    if entry["fingerprint"] != fingerprint:
        log.info("ignoring %d partial generations made under another config", entry["num_rows"])
        return {}
    store = open_store(out_dir)
    name = f"{MANIFEST_DIR}/{entry['file']}"
    path = store / name
    try:
        data = store.read_bytes(name)
    except OSError as e:
        log.warning("partial generations %s unreadable (%s); those rows start over", path, e)
        return {}
    if (len(data), hashlib.sha256(data).hexdigest()) != (entry["num_bytes"], entry["sha256"]):
        log.warning("partial generations %s do not match their manifest entry; those rows start over", path)
        return {}
    payload = json.loads(data)
    assert payload["fingerprint"] == fingerprint, "partials file and its entry disagree"
    rows = [PartialRow.from_json(d) for d in payload["rows"]]
    assert len(rows) == entry["num_rows"], "partials file and its entry disagree"
    return {r.key: r for r in rows}


def clean_partial_files(out_dir: Path | OutputStore, keep: str | None) -> None:
    """Delete partial files other than `keep` (the latest entry's): superseded, or never committed."""
    store = open_store(out_dir)
    for name in store.list(MANIFEST_DIR):
        if name.endswith(PARTIALS_SUFFIX) and name != keep:
            store.delete(f"{MANIFEST_DIR}/{name}")
