"""--lora NAME=DIR and --lora-column: which adapters a job loads and how a row names its own.

Checked before anything loads: the names and their directories' shape here; each adapter's config
(jobs/durability/fingerprint.py, through engine/lora/files.py) before the model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.config.keys import label
from batchgen.errors import ConfigError

if TYPE_CHECKING:
    from batchgen.config.job import JobConfig

def lora_settings(config: JobConfig) -> None:
    """Normalize `lora` (the flag's NAME=DIR strings, or YAML's mapping) to {name: dir}, then refuse
    what cannot work whatever the adapters hold."""
    config.lora = parse_lora(config.lora)
    if config.lora_column is not None and (not isinstance(config.lora_column, str) or not config.lora_column):
        raise ConfigError(f"{label('lora_column')} must name an input column, got {config.lora_column!r}")
    if not config.lora:
        if config.lora_column is not None:
            raise ConfigError(f"{label('lora_column')} names each row's adapter: load them with --lora NAME=DIR")
        return
    if config.compile:
        raise ConfigError("--lora runs on the eager forward: drop --compile")
    if config.input_format == "openai-batch":  # rules.OPENAI_BATCH (rules imports this module): `model` names it
        if config.lora_column is not None:
            raise ConfigError(f"{label('lora_column')} does not apply to --input-format openai-batch: a request's "
                              "body names its adapter in `model`")
    elif config.lora_column is None and len(config.lora) > 1:
        raise ConfigError(f"{len(config.lora)} adapters loaded ({', '.join(config.lora)}) and no --lora-column to "
                          "say which row takes which: pass --lora-column COL, or one --lora for every row")


def parse_lora(value) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple):
        pairs = {}
        for item in value:
            name, sep, path = str(item).partition("=")
            if not sep:
                raise ConfigError(f"{label('lora')}: expected NAME=DIR, got {item!r}")
            if name.strip() in pairs:
                raise ConfigError(f"{label('lora')}: adapter {name.strip()!r} given twice")
            pairs[name.strip()] = path.strip()
        value = pairs
    if not isinstance(value, dict):
        raise ConfigError(f"{label('lora')} must map adapter names to PEFT adapter directories, got {value!r}")
    for name, path in value.items():
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ConfigError(f"{label('lora')}: expected NAME=DIR with both given, got {name!r}={path!r}")
    return dict(value)
