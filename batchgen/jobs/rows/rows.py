"""Input rows of a job: checked up front, then streamed file by file with stable ids.

Everything a user can get wrong about the input (missing file, missing column, corrupt footer,
empty file, a template naming a column that does not exist, two files whose columns have types
that cannot be unified) is checked by `RowSource.open`, before a model is loaded or an output
directory is touched. Every file's schema is read up front (Parquet footers; JSON Lines from the
sample its reader types it by). Columns a job needs (prompt, template, id, limits, --keep-columns)
must be in every file. The passthrough columns are the union of the files' columns, unified by
pyarrow (int32 and int64 give int64, int and float give float64); a column a file lacks is null
in its rows. A type conflict (a string column in one file, an integer in another) is refused
naming both files, so a job never fails half way through its inputs.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.config.constraint import writes_json_valid
from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.config.suggest import closest
from batchgen.errors import ConfigError, InputError
from batchgen.io.inputs.cells import invalid_cells, json_cells
from batchgen.io.inputs.discovery import InputFile, resolve_inputs
from batchgen.io.inputs.readers import holds_no_rows, iter_batches, read_schema
from batchgen.io.store.schema import ADAPTER, JSON_VALID, LOGPROBS, OUTPUT_FIXED_FIELDS
from batchgen.jobs.prompting.chat_rows import is_conversation
from batchgen.jobs.prompting.prompts import Template
from batchgen.jobs.rows.split import split_inputs

# the columns of an OpenAI Batch API request file, read without --input-format openai-batch
OPENAI_BATCH_SHAPE = {"custom_id", "method", "url", "body"}
DERIVED_ID_COLUMN = "row_id"  # output id column when ids are derived from file name + row index


@dataclass(slots=True)
class InputRow:
    row_id: Any  # the id column's value, or "<file>:<row index>"
    file: InputFile
    row_index: int  # 0-based within the file (also in a sharded job's share of it)
    values: dict[str, Any]  # the columns read (template, max-tokens and passthrough columns)
    error: str | None = None  # a cell did not hold valid text (read with U+FFFD): an error row
    # the prompt column's conversation, where it holds chat messages and no --template is set
    # (batchgen.jobs.prompting.chat_rows): the prompt is built from these, not from the template
    messages: list[dict[str, Any]] | None = None


class RowSource:
    def __init__(self, config: JobConfig, files: list[InputFile], schema: pa.Schema,
                 template: Template, file_schemas: list[pa.Schema] | None = None):
        self.config = config
        self.files = files
        self.file_schemas = file_schemas if file_schemas is not None else [schema] * len(files)
        self.max_rows = config.max_rows  # rows read at most, over all files in order; None = all
        self.job_files: list[tuple[InputFile, pa.Schema]] | None = None  # a sharded job's files, all of them
        self.template = template
        # an input of empty JSON Lines files alone has no columns: its (absent) ids are strings
        self.id_field = (schema.field(config.id_column) if config.id_column in schema.names
                         else pa.field(config.id_column or DERIVED_ID_COLUMN, pa.string()))
        self.passthrough_fields = _passthrough(config, schema, self.id_field.name)
        needed = [*template.columns, *_optional_columns(config), *[f.name for f in self.passthrough_fields]]
        self.read_columns = list(dict.fromkeys(needed))
        self._file_labels = _file_labels(files)

    @classmethod
    def open(cls, config: JobConfig) -> RowSource:
        """Every file of the job is checked and its schema read, also by a shard of a sharded job
        (--num-shards): all shards then agree on the output schema (the union of the files'
        columns) and on the labels of derived ids, and fail alike on a bad file."""
        source = cls._open_all(config)
        if config.num_shards is not None:
            source._restrict(split_inputs(source.files, config.num_shards, config.shard_index, config.max_rows))
        return source

    def _restrict(self, share: list[InputFile]) -> None:
        """Read only a sharded job's share (batchgen.jobs.rows.split): some files, some cut to a row
        range. Labels stay those of all files; --max-rows was applied before the split."""
        self.job_files = list(zip(self.files, self.file_schemas, strict=True))  # every file of the job
        position = {s.path: i for i, s in enumerate(self.files)}
        keep = [position[s.path] for s in share]
        self.files = share
        self.file_schemas = [self.file_schemas[i] for i in keep]
        self._file_labels = [self._file_labels[i] for i in keep]
        self.max_rows = None

    @classmethod
    def _open_all(cls, config: JobConfig) -> RowSource:
        files = resolve_inputs(config.inputs, config.input_format)
        template = Template(config.template, config.prompt_column)
        schemas = []
        for file in files:
            schema = read_schema(file)  # corrupt files fail here, naming the file
            if schema.names or not holds_no_rows(file):  # an empty JSON Lines file has no columns to check
                _check_columns(config, template, schema, file.path)
            schemas.append(schema)
        used = schemas
        if config.keep_columns is not None:  # only the columns the job reads need to agree
            names = {*template.columns, *_optional_columns(config), *config.keep_columns}
            used = [pa.schema([f for f in schema if f.name in names]) for schema in schemas]
        return cls(config, files, unify_schemas(files, used), template, schemas)

    @property
    def num_rows(self) -> int | None:
        """Total rows if every file knows its count (Parquet), capped by --max-rows."""
        counts = [s.num_rows_read for s in self.files]
        total = None if any(c is None for c in counts) else sum(counts)
        if self.max_rows is not None:
            return self.max_rows if total is None else min(total, self.max_rows)
        return total

    def iter_ids(self, file_rows: list[tuple[str, int]]) -> Iterator[Any]:
        """The ids of the rows `__iter__` yields, reading the id column alone (derived ids: nothing).
        `file_rows`: (path, rows read) per file, from the input scan (which applied --max-rows)."""
        for ids in self.iter_id_batches(file_rows):
            yield from ids

    def iter_id_batches(self, file_rows: list[tuple[str, int]]) -> Iterator[list[Any]]:
        """The same ids, a list per input batch (a batch id lookup takes them so)."""
        batch_size = self.config.read_batch_size
        for file, label, (_, num_rows) in zip(self.files, self._file_labels, file_rows, strict=True):
            if not self.config.id_column:
                for start in range(file.first_row, file.first_row + num_rows, batch_size):
                    yield [f"{label}:{i}" for i in range(start, min(start + batch_size, file.first_row + num_rows))]
                continue
            n = 0
            for batch in iter_batches(file, [self.config.id_column], batch_size):
                yield batch.column(0).to_pylist()[: num_rows - n]
                n += batch.num_rows
                if n >= num_rows:
                    break

    def __iter__(self) -> Iterator[InputRow]:
        for chunk in self.chunks():
            yield from chunk.rows()

    def chunks(self) -> Iterator[RowChunk]:
        """The rows in input batches, each batch's ids known before any row of it is built: a
        resume skips committed rows a batch at a time (batchgen.jobs.durability.resume) and never builds them."""
        remaining = self.max_rows
        for file, label, schema in zip(self.files, self._file_labels, self.file_schemas, strict=True):
            row_index = file.first_row  # ids and the manifest count rows from the file's start
            # a passthrough column this file lacks is null in its rows (values.get gives None)
            columns = [c for c in self.read_columns if c in schema.names]
            for batch in iter_batches(file, columns, self.config.read_batch_size):
                if remaining is not None:
                    if remaining <= 0:
                        return
                    batch = batch.slice(0, remaining)
                    remaining -= batch.num_rows
                if self.config.id_column:
                    ids = batch.column(self.config.id_column).to_pylist()
                    if batch.column(self.config.id_column).null_count:
                        raise InputError("id is null; every row needs an id", path=file.path,
                                         row=row_index + ids.index(None), column=self.config.id_column)
                else:
                    ids = [f"{label}:{i}" for i in range(row_index, row_index + batch.num_rows)]
                yield RowChunk(file, row_index, ids, batch, self.template)
                row_index += batch.num_rows


@dataclass(slots=True)
class RowChunk:
    """One input batch: its rows' ids, and the rows themselves built only when asked for."""

    file: InputFile
    first_row: int  # the row index (within its file) of the batch's first row
    ids: list[Any]
    batch: pa.RecordBatch
    template: Template | None = None  # its columns must hold text: other cells make error rows

    def rows(self, positions: list[int] | None = None) -> Iterator[InputRow]:
        """The rows at `positions` within the batch (all of them: None), in order."""
        batch = self.batch if positions is None else self.batch.take(pa.array(positions, pa.int64()))
        invalid = invalid_cells(self.batch)  # by position in the whole batch
        nested = json_cells(self.batch)
        columns = [] if self.template is None else [c for c in self.template.columns if c in batch.schema.names]
        typed = [c for c in columns if not _text_like(batch.schema.field(c).type)]
        where = range(len(self.ids)) if positions is None else positions
        for k, values in zip(where, batch.to_pylist(), strict=True):
            row = InputRow(self.ids[k], self.file, self.first_row + k, values, invalid.get(k))
            if row.error is None and (typed or k in nested):
                row.error, row.messages = self._non_text(values, typed, nested.get(k, ()), row.row_index)
            yield row

    def _non_text(self, values: dict[str, Any], typed: list[str], nested: Iterable[str], row: int
                  ) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(error, conversation) of a row whose template column holds no text: a Parquet list,
        struct, map or bytes cell, or a JSON Lines array or object (held as its JSON text,
        batchgen.io.inputs.jsonl), is an error, but for chat messages in the prompt column with no
        --template, which are the row's conversation (batchgen.jobs.prompting.chat_rows), in either format.
        Numbers are text to the template (batchgen.jobs.prompting.template), in either format."""
        template = self.template
        assert template is not None
        messages = None
        for name in template.columns:
            if name in nested:
                value = json.loads(values[name])
            elif name in typed and values.get(name) is not None:
                value = values[name]
            else:
                continue
            if template.text is None and name == template.prompt_column and is_conversation(value):
                messages = value
                continue
            label = f"prompt column {name!r}" if name == template.prompt_column else f"column {name!r}"
            message = f"{label} holds a {type(value).__name__}, not text ({self.file.path}, row {row})"
            if is_conversation(value):
                message += ("; chat messages are a conversation only as the prompt column with no --template "
                            "(or as OpenAI Batch requests: --input-format openai-batch)")
            return message, None
        return None, messages


def _text_like(arrow_type: pa.DataType) -> bool:
    """A type whose values the template reads as text: strings, numbers (decimals too, as a JSON Lines
    number is), bools (and null)."""
    t = arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t) or pa.types.is_null(t))


def unify_schemas(files: list[InputFile], schemas: list[pa.Schema]) -> pa.Schema:
    """One schema over every file (pyarrow's permissive unification); a conflict names both files."""
    first: dict[str, tuple[pa.DataType, str]] = {}  # column -> (type, path) where first seen
    for file, schema in zip(files, schemas, strict=True):
        for f in schema:
            if f.name not in first:
                first[f.name] = (f.type, file.path)
                continue
            seen_type, seen_path = first[f.name]
            try:
                pa.unify_schemas([pa.schema([pa.field(f.name, seen_type)]), pa.schema([f])],
                                 promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                raise InputError(f"holds {f.type}, but {seen_path} holds {seen_type} in this column; input "
                                 "files must agree on column types (drop the column with --keep-columns, or "
                                 "convert one file)", path=file.path, column=f.name) from None
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # a conflict between promoted types
        raise InputError(f"input files disagree on column types: {e}") from None


def _check_columns(config: JobConfig, template: Template, schema: pa.Schema, path: str) -> None:
    names = schema.names
    listed = ", ".join(names)
    if config.prompt_column not in names and config.template is None:
        likely = likely_prompt_column(schema, config.prompt_column)
        hint = f"; pass --prompt-column {likely}" if likely else "; no column holds text"
        if OPENAI_BATCH_SHAPE <= set(names):  # its body column is a request, not a prompt
            hint = f"; these are OpenAI Batch API requests: pass --input-format {OPENAI_BATCH}"
        raise InputError(f"prompt column {config.prompt_column!r} not found; columns: {listed}{hint}",
                         path=path)
    template.check_columns(names, path)
    for flag, column in (("--id-column", config.id_column),
                         ("--max-new-tokens-column", config.max_new_tokens_column),
                         ("--length-column", config.length_column),
                         ("--sampling-column", config.sampling_column),
                         ("--json-schema-column", config.json_schema_column),
                         ("--constraint-column", config.constraint_column),
                         ("--lora-column", config.lora_column)):
        if column is not None and column not in names:
            raise InputError(f"{flag} {column!r} not found; columns: {listed}{_pass(flag, column, names)}", path=path)
    for column in config.keep_columns or []:
        if column not in names:
            raise InputError(f"--keep-columns {column!r} not found; columns: {listed}"
                             f"{_pass('--keep-columns', column, names)}", path=path)


def _optional_columns(config: JobConfig) -> list[str]:
    """The columns a row's own settings come from, where set."""
    optional = [config.max_new_tokens_column, config.length_column, config.sampling_column, config.id_column,
                config.json_schema_column, config.constraint_column, config.lora_column]
    return [c for c in optional if c]


def _pass(flag: str, asked: str, names: list[str]) -> str:
    """"; pass FLAG NAME" for the column a typo most likely meant, as a missing prompt column is answered."""
    meant = closest(asked, names)
    return f"; pass {flag} {meant}" if meant is not None else ""


# what people call the column a prompt comes from, likeliest first
_PROMPT_NAMES = ("prompt", "text", "body", "content", "document", "doc", "article", "input", "question",
                 "instruction", "message", "query", "passage", "context", "source")


def likely_prompt_column(schema: pa.Schema, asked: str) -> str | None:
    """The text column a user most likely meant: a usual name, else the closest name, else the
    only text column. None when no column holds text."""
    text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    if not text:
        return None
    lowered = {name.lower(): name for name in text}
    for common in _PROMPT_NAMES:
        if common in lowered:
            return lowered[common]
    close = closest(asked, text)
    if close is not None:
        return close
    not_ids = [n for n in text if not n.lower().endswith(("id", "_key", "uuid"))]
    return (not_ids or text)[0]


def _passthrough(config: JobConfig, schema: pa.Schema, id_name: str) -> list[pa.Field]:
    names = config.keep_columns if config.keep_columns is not None else schema.names
    # only a real --id-column is dropped from the passthrough; an input column that merely shares the
    # derived id's name would be lost silently, so it is reported as a clash below instead
    fields = [schema.field(n) for n in names if n != config.id_column and n in schema.names]  # (empty files: none)
    if config.lora and config.lora_column == ADAPTER:  # the output column of that name carries its adapters
        fields = [f for f in fields if f.name != ADAPTER]
    reserved = {f.name for f in OUTPUT_FIXED_FIELDS} | {id_name}
    if config.logprobs is not None:
        reserved.add(LOGPROBS)
    if writes_json_valid(config):
        reserved.add(JSON_VALID)
    if config.lora:
        reserved.add(ADAPTER)
    clash = [f.name for f in fields if f.name in reserved]
    if clash:
        raise ConfigError(f"input column(s) {', '.join(map(repr, clash))} would overwrite output columns; "
                          "choose the columns to keep with --keep-columns")
    return fields


def _file_labels(files: list[InputFile]) -> list[str]:
    """A short stable label per file for derived ids: the file name, or the path if names repeat."""
    names = [os.path.basename(s.path.rstrip("/")) for s in files]
    repeated = {n for n, c in Counter(names).items() if c > 1}
    return [s.path if n in repeated else n for s, n in zip(files, names, strict=True)]
