"""What a sentence-transformers directory says about how it embeds: read from its files, no torch.

A sentence-transformers model is a pipeline of modules (`modules.json`): a Transformer (the HF model,
at the directory's root or a sub-folder), a Pooling module (`1_Pooling/config.json`), and optionally a
Normalize module. Both the legacy file layout (`pooling_mode_mean_tokens: true`, `word_embedding_dimension`,
`sentence_bert_config.json`'s `max_seq_length`) and the current one (`pooling_mode: "mean"`,
`embedding_dimension`, the length in the tokenizer's `model_max_length`) are read. A pipeline with any
other module (Dense, LayerNorm, a router, ...) is refused: its vectors would differ from what pooling
alone gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchgen.config.choices import Pooling
from batchgen.errors import UnsupportedModelError

MODULES_FILE = "modules.json"

# sentence-transformers' pooling mode names -> ours (its "lasttoken" is our "last")
_POOLING_MODES = {"mean": Pooling.MEAN, "cls": Pooling.CLS, "lasttoken": Pooling.LAST}
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                        "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True, slots=True)
class StConfig:
    transformer_dir: Path  # where the HF model and tokenizer files are
    pooling: Pooling | None  # None: the directory has no Pooling module
    normalize: bool  # a Normalize module follows pooling
    embedding_dim: int | None  # the Pooling module's dimension
    max_seq_length: int | None  # sentence_bert_config.json's (legacy layout); None: the tokenizer's model_max_length


def is_st_dir(directory: Path) -> bool:
    return (directory / MODULES_FILE).is_file()


def read_st_config(directory: Path) -> StConfig:
    """The embedding recipe of the sentence-transformers directory `directory`."""
    modules = _read_json(directory / MODULES_FILE)
    transformer_dir: Path | None = None
    pooling: Pooling | None = None
    embedding_dim: int | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = directory / module.get("path", "")
        if kind == "Transformer" and transformer_dir is None:
            transformer_dir = path
        elif kind == "Pooling" and pooling is None and transformer_dir is not None:
            pooling, embedding_dim = _read_pooling(path / "config.json", directory)
        elif kind == "Normalize" and pooling is not None:
            normalize = True
        else:
            raise UnsupportedModelError(
                f"sentence-transformers model {directory}: module {module.get('type')!r} at position "
                f"{module.get('idx')} is not supported (only Transformer, Pooling, Normalize, in that order)")
    if transformer_dir is None:
        raise UnsupportedModelError(f"sentence-transformers model {directory}: {MODULES_FILE} names no Transformer")
    st_file = transformer_dir / "sentence_bert_config.json"
    settings = _read_json(st_file) if st_file.is_file() else {}
    if settings.get("do_lower_case"):
        raise UnsupportedModelError(f"sentence-transformers model {directory}: do_lower_case (lower-casing the "
                                    f"text before its tokenizer) is not supported")
    max_seq_length = settings.get("max_seq_length")
    return StConfig(transformer_dir=transformer_dir, pooling=pooling, normalize=normalize,
                    embedding_dim=embedding_dim, max_seq_length=int(max_seq_length) if max_seq_length else None)


def _read_pooling(path: Path, directory: Path) -> tuple[Pooling, int | None]:
    config = _read_json(path)
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise UnsupportedModelError(f"sentence-transformers model {directory}: pooling {' + '.join(modes) or 'none'} "
                                    f"is not supported (one of {', '.join(_POOLING_MODES)})")
    if config.get("include_prompt") is False:
        raise UnsupportedModelError(f"sentence-transformers model {directory}: pooling that leaves out the prompt's "
                                    f"tokens (include_prompt: false) is not supported")
    dim = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    return _POOLING_MODES[modes[0]], int(dim) if dim else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e
