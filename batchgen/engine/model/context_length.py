"""A model's context length from its files alone, before any weight is read.

A job whose --max-new-tokens fills the whole context leaves no room for any prompt: every row
would become an error row. The job checks it before the model loads (and before torch imports),
so the numbers come from the files: a directory's config.json (max_position_embeddings, in its
text_config for a multimodal one) and tokenizer_config.json (model_max_length), a GGUF's metadata
(`<architecture>.context_length`, the embedded model's too), a hub model's cached config. The
loaded model's limit follows the same rule (`context_limit`): the smaller of the two, a tokenizer
without a real limit ignored.

No torch, no transformers here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from batchgen.engine.model.gguf_metadata import read_metadata
from batchgen.engine.model.model_files import DEFAULT_MODEL, default_gguf_path
from batchgen.errors import BatchgenError

MAX_SANE_TOKENIZER_LENGTH = 1_000_000  # tokenizers without a limit report 1e30
# config keys naming the context (GPT-2's family says n_positions; transformers maps it the same way)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")


def context_limit(from_config: Any, from_tokenizer: Any) -> int | None:
    """The model's context in tokens: the smaller of its config's and its tokenizer's limits, each
    only where it is a real one; None when neither is."""
    if not (isinstance(from_tokenizer, int) and 0 < from_tokenizer < MAX_SANE_TOKENIZER_LENGTH):
        from_tokenizer = None
    if not (isinstance(from_config, int) and from_config > 0):
        from_config = None
    limits = [n for n in (from_config, from_tokenizer) if n]
    return min(limits) if limits else None


def context_tokens_from_files(name: str | None) -> int | None:
    """The context length of the model `name` (None: the embedded default) from its files; None
    where they cannot tell it cheaply (a hub model not cached, a file that does not parse): the
    model's load then finds and reports it."""
    try:
        if name in (None, DEFAULT_MODEL):
            return _from_gguf(default_gguf_path())
        local = Path(os.path.expanduser(str(name)))
        if local.is_file():
            return _from_gguf(local) if local.suffix == ".gguf" else None
        if local.is_dir():
            return _from_config_files(local / "config.json", local / "tokenizer_config.json")
        if str(name).count("/") == 1 and not str(name).startswith(("/", "./", "../", "~")):
            return _from_hub_cache(str(name))
    except (BatchgenError, OSError, ValueError):  # an unreadable file: the load says what is wrong
        return None
    return None


def _from_gguf(path: Path) -> int | None:
    metadata = read_metadata(path)
    arch = str(metadata.get("general.architecture", ""))
    return context_limit(metadata.get(f"{arch}.context_length"), None)


def _from_config_files(config_path: Path, tokenizer_path: Path | None) -> int | None:
    config = _json(config_path)
    if config is None:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    from_config = next((text[key] for key in CONTEXT_KEYS if key in text), None)
    tokenizer = _json(tokenizer_path) if tokenizer_path is not None else None
    return context_limit(from_config, (tokenizer or {}).get("model_max_length"))


def _from_hub_cache(repo_id: str) -> int | None:
    from huggingface_hub import try_to_load_from_cache  # no torch; only a hub id pays its import

    config = try_to_load_from_cache(repo_id, "config.json")
    tokenizer = try_to_load_from_cache(repo_id, "tokenizer_config.json")
    if not isinstance(config, str):  # not cached (None), or cached as absent
        return None
    return _from_config_files(Path(config), Path(tokenizer) if isinstance(tokenizer, str) else None)


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else None
