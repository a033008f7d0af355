"""The manifest's entry files: where they are, how they are named, read and listed.

`_manifest/NNNNNNNN.json`, one per entry, numbered without gaps (batchgen.io.manifest.manifest writes them;
batchgen.io.manifest.state replays them). Also what a committed part's rows were made from, read
back from the entry (or the snapshot) that wrote it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import OutputStore

MANIFEST_DIR = "_manifest"
FORMAT = 1
ENTRY_RE = re.compile(r"(\d{8})\.json")


class EntryVanished(OutputError):
    """An entry listed a moment ago is gone, or the listing has a gap: damage to a job holding the
    lock, but to a lockless reader (`status`) the usual sign of a consolidation (a snapshot's
    drop_before) deleting old entries between its listing and its reads: it lists again."""


def manifest_dir(out_dir: str | Path) -> Path:
    """The local manifest directory (tests and local tools); the io modules go through the store."""
    return Path(out_dir) / MANIFEST_DIR


def entry_name(seq: int) -> str:
    return f"{MANIFEST_DIR}/{seq:08d}.json"


def is_job_dir(out_dir: str | Path | OutputStore) -> bool:
    return open_store(out_dir).is_dir(MANIFEST_DIR)


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_entry_file(store: OutputStore, name: str) -> dict[str, Any]:
    try:
        return json.loads(store.read_bytes(name))
    except FileNotFoundError as e:
        raise EntryVanished(f"manifest entry {store / name} is missing ({e}); the output directory is damaged: "
                            "pass --overwrite to start over") from e
    except (OSError, ValueError) as e:  # an entry is written whole (rename, or one PUT): this is damage
        raise OutputError(f"manifest entry {store / name} is unreadable ({e}); the output directory is "
                          "damaged: pass --overwrite to start over") from e


def read_entry(out_dir: str | Path | OutputStore, seq: int) -> dict[str, Any]:
    return read_entry_file(open_store(out_dir), entry_name(seq))


def entry_epoch(entry: dict[str, Any]) -> int:
    """The lease epoch an entry was written under (batchgen.io.store.lease); 0 for a local store's."""
    return int(entry.get("epoch") or 0)


def listed_entries(store: OutputStore) -> dict[int, str]:
    """{seq: name} of the entry files listed now, gaps and all (a reader follows the chain)."""
    return {int(m.group(1)): f"{MANIFEST_DIR}/{name}" for name in store.list(MANIFEST_DIR)
            if (m := ENTRY_RE.fullmatch(name))}


def entry_paths(store: OutputStore) -> list[tuple[int, str]]:
    """(seq, name) of every entry, oldest first; a gap is damage."""
    names = store.list(MANIFEST_DIR)
    entries = sorted((int(m.group(1)), f"{MANIFEST_DIR}/{name}") for name in names
                     if (m := ENTRY_RE.fullmatch(name)))
    for (a, _), (b, name) in zip(entries, entries[1:], strict=False):
        if b != a + 1:
            raise EntryVanished(f"manifest is damaged: entry {a + 1:08d}.json is missing before {name}")
    return entries
