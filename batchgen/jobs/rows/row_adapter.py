"""A row's LoRA adapter (--lora, --lora-column; an OpenAI Batch request's `model`) and what it adds
to the row's identity.

A null or empty cell runs the base model. A cell naming an adapter the job did not load is that
row's error (naming the file, the row and the column), not the job's: the other rows go on.
"""

from __future__ import annotations

from typing import Any

from batchgen.config.job import JobConfig
from batchgen.engine.lora.files import adapter_hashes
from batchgen.jobs.prompting.prompts import RowError
from batchgen.jobs.rows.rows import InputRow


def row_adapter(row: InputRow, config: JobConfig) -> str | None:
    """The adapter `row` runs with; None for the base model."""
    if not config.lora:
        return None
    column = config.lora_column
    if column is None:  # one --lora for every row (lora_settings refuses several without a column)
        return next(iter(config.lora))
    cell = row.values.get(column)
    if cell is None or cell == "":
        return None
    where = f"{row.file.path}, row {row.row_index}, column {column!r}"
    if not isinstance(cell, str):
        raise RowError(f"{where}: a LoRA adapter's name must be text, got {type(cell).__name__}", column=column)
    if cell not in config.lora:
        raise RowError(f"{where}: unknown LoRA adapter {cell!r} (loaded: {', '.join(config.lora)})", column=column)
    return cell


def request_adapter(model: Any, config: JobConfig) -> str | None:
    """An OpenAI Batch request's adapter: its body's `model` when that names a loaded adapter (any
    other model name runs the job's model, as before adapters)."""
    return model if isinstance(model, str) and model in config.lora else None


def adapter_identity(adapter: str | None, config: JobConfig) -> dict[str, str] | None:
    """What a row's prompt hash records of its adapter: its name and content hash."""
    if adapter is None:
        return None
    return {"name": adapter, "hash": adapter_hashes({adapter: config.lora[adapter]})[adapter]}
