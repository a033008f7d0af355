"""An embed job's vector size from the model's files, before any weight is read.

The output schema (`embedding fixed_size_list<float32>[dim]`) enters the fingerprint, which a run
checks before it loads the model, so the size must come from the files: a sentence-transformers
directory's last Pooling or Dense module (modules.json, its config.json), else config.json's
hidden_size (in text_config for a multimodal one); --dimensions cuts it (Matryoshka). None where
the files cannot tell (a hub model not in the local cache): the run then loads the model first.

No torch, no transformers here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def embedding_dim_from_files(model_path: str | Path | None, dimensions: int | None) -> int | None:
    """The embedding's size an embed job writes with the model at `model_path` (a directory)."""
    if model_path is None or not Path(model_path).is_dir():
        return None
    path = Path(model_path)
    dim = _sentence_transformers_dim(path)
    if dim is None:
        config = _json(path / "config.json") or {}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        dim = text.get("hidden_size") if isinstance(text.get("hidden_size"), int) else None
    if dim is None:
        return None
    return min(dim, dimensions) if dimensions is not None else dim


def _sentence_transformers_dim(path: Path) -> int | None:
    modules = _json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    dim = None
    for module in modules:  # in order: a Dense after the pooling changes the size
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        config = _json(path / str(module.get("path", "")) / "config.json") if kind else None
        if config is None:
            continue
        if kind.endswith("Pooling") and isinstance(config.get("word_embedding_dimension"), int):
            dim = config["word_embedding_dimension"]
        elif kind.endswith("Dense") and isinstance(config.get("out_features"), int):
            dim = config["out_features"]
    return dim


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
