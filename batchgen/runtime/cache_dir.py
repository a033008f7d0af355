"""Where batchgen keeps what it builds once per machine: converted models, compiled kernels, inductor code.

One root for all of them, so a user moves or clears batchgen's cache with one variable
(BATCHGEN_CACHE_DIR, else $XDG_CACHE_HOME/batchgen, else ~/.cache/batchgen).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return Path(os.environ["BATCHGEN_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "batchgen"
