"""The OpenAI Batch files' temps: held by their writer until renamed in, swept once it is gone.

A writer writes each file under a hidden name of its own (`.output.jsonl.<token>.tmp`), so a kill
before the rename leaves them behind, in places no recovery lists (`_openai_batch/`, a sharded
job's directory). The writer holds an flock on each temp until it is renamed in; the next writer
deletes the temps nobody holds, whose writer is gone. A live writer's temps (two writers that raced
past the output's lock) stay held and are left alone, so each still renames in a whole file of its own.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from batchgen.io.store.local_files import TEMP_SUFFIX

try:
    import fcntl
except ImportError:  # Windows: no flock, so no temp can be told dead; none is swept
    fcntl = None

log = logging.getLogger("batchgen")


def open_held(path: Path) -> BinaryIO:
    """A new temp at `path`, opened for writing and held (flock) until the file is closed."""
    file = open(path, "xb")
    if fcntl is not None:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: never held by another
        except OSError:  # a filesystem without flock: unheld, and sweep_dead_temps cannot take it either
            pass
    return file


def sweep_dead_temps(directory: Path, names: Iterable[str]) -> list[str]:
    """Delete the hidden temps of `names` in `directory` that no live writer holds; their names.
    Only a writer's own names (`.<name>.<8 hex digits>.tmp`): the directory may be the user's."""
    if fcntl is None:
        return []
    ours = re.compile("|".join(rf"\.{re.escape(name)}\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}" for name in names))
    try:
        candidates = [e.name for e in os.scandir(directory) if ours.fullmatch(e.name)]
    except FileNotFoundError:
        return []
    swept = []
    for name in sorted(candidates):
        try:
            fd = os.open(directory / name, os.O_RDONLY)
        except FileNotFoundError:  # renamed in or swept meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer is alive (or the filesystem has no flock: cannot tell)
            continue
        else:
            (directory / name).unlink(missing_ok=True)
            swept.append(name)
        finally:
            os.close(fd)
    if swept:
        log.info("removed %d Batch file temps of a writer that was stopped in %s: %s", len(swept), directory,
                 ", ".join(swept))
    return swept
