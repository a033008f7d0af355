"""`batchgen run`: input rows -> prompts -> engine -> Parquet parts in the output directory.

Order of work, so that a mistake costs nothing: check the inputs and the config (no model loaded,
no output written), then load the model, then stream. Rows whose prompt cannot be built (null or
empty prompt, bad per-row limit, too long with --on-long-prompt error) become error rows: the
job completes and writes exactly one output row per input row.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgen.config import JobConfig, parse_bytes
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.loader import LoadedModel, load_model
from batchgen.engine.request import Completion, Request, SamplingParams
from batchgen.engine.scheduler import Policy
from batchgen.errors import ErrorRateExceeded, OutputError
from batchgen.io.writers import PartWriter, check_output_dir, cleanup_temp_files, output_schema
from batchgen.jobs.progress import Progress
from batchgen.jobs.prompts import PromptBuilder, RowError, row_max_new_tokens
from batchgen.jobs.report import JobSummary
from batchgen.jobs.rows import InputRow, RowSource

log = logging.getLogger("batchgen")

SUMMARY_FILE = "_summary.json"


def build_engine(config: JobConfig, loaded: LoadedModel) -> LLMEngine:
    engine_config = EngineConfig(
        policy=Policy(config.mode),
        max_num_seqs=config.batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        kv_cache_bytes=parse_bytes(config.kv_cache_memory) if config.kv_cache_memory else None,
        enable_prefix_caching=config.enable_prefix_caching,
        max_model_len=loaded.max_context_tokens,
    )
    return LLMEngine(loaded.model, loaded.tokenizer, engine_config, eos_token_ids=loaded.eos_token_ids)


def row_seed(base_seed: int, row_id: Any) -> int:
    """A per-row seed from the job seed and the row id: stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{base_seed}\x00{row_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Job:
    def __init__(self, config: JobConfig, source: RowSource, loaded: LoadedModel, out_dir: Path):
        self.config = config
        self.source = source
        self.engine = build_engine(config, loaded)
        self.builder = PromptBuilder(
            loaded.tokenizer, source.template, system=config.system, chat=config.chat,
            max_context_tokens=self.engine.max_tokens_per_seq, on_long_prompt=config.on_long_prompt,
            max_prompt_tokens=config.max_prompt_tokens)
        self.writer = PartWriter(out_dir, output_schema(source.id_field, source.passthrough_fields))
        self.id_name = source.id_field.name
        self.passthrough = [f.name for f in source.passthrough_fields]
        self.pending: dict[str, tuple[InputRow, int]] = {}  # request id -> (row, truncated tokens)
        self.buffer: list[dict[str, Any]] = []
        self.progress = Progress(source.num_rows, quiet=config.quiet, log_every_s=config.log_every_s)
        self.summary = JobSummary(output_dir=str(out_dir), model=loaded.name, mode=config.mode)

    def requests(self) -> Iterator[Request]:
        config = self.config
        keys = itertools.count()
        for row in self.source:
            try:
                max_new = row_max_new_tokens(row.values, config.max_new_tokens_column, config.max_new_tokens)
                prompt = self.builder.build(row.values, max_new)
            except RowError as e:
                self.emit(self.output_row(row, error=str(e)))
                continue
            key = str(next(keys))
            self.pending[key] = (row, prompt.num_truncated_tokens)
            yield Request(key, prompt.token_ids, SamplingParams(
                max_new_tokens=max_new, temperature=config.temperature, top_p=config.top_p,
                top_k=config.top_k, seed=row_seed(config.seed, row.row_id), stop=tuple(config.stop),
                ignore_eos=config.ignore_eos))

    def run(self) -> JobSummary:
        started = time.monotonic()
        try:
            for completion in self.engine.generate(self.requests()):
                row, num_truncated = self.pending.pop(completion.request_id)
                self.summary.num_rows_truncated += int(num_truncated > 0)
                self.emit(self.output_row(row, completion=completion))
            assert not self.pending, f"{len(self.pending)} rows lost in the engine"
            self.flush()
        finally:
            self.progress.close()
        self.summary.wall_seconds = time.monotonic() - started
        self.summary.engine = self.engine.metrics.summary()
        return self.summary

    def output_row(self, row: InputRow, *, completion: Completion | None = None,
                   error: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {self.id_name: row.row_id}
        if completion is not None:
            out.update(generated_text=completion.text, finish_reason=completion.finish_reason.value,
                       num_prompt_tokens=completion.num_prompt_tokens,
                       num_generated_tokens=completion.num_generated_tokens, error=None)
        else:
            out.update(generated_text=None, finish_reason="error", num_prompt_tokens=None,
                       num_generated_tokens=0, error=error)
        for name in self.passthrough:
            out[name] = row.values.get(name)
        return out

    def emit(self, out: dict[str, Any]) -> None:
        s = self.summary
        s.num_rows += 1
        is_error = out["finish_reason"] == "error"
        s.num_rows_error += int(is_error)
        s.num_rows_ok += int(not is_error)
        s.num_prompt_tokens += out["num_prompt_tokens"] or 0
        s.num_generated_tokens += out["num_generated_tokens"] or 0
        self.progress.update(num_generated_tokens=out["num_generated_tokens"] or 0, error=is_error)
        self.buffer.append(out)
        if len(self.buffer) >= self.config.rows_per_part:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.writer.write_part(self.buffer)
            self.summary.num_parts_written += 1
            self.buffer = []


def run_job(config: JobConfig, *, loaded: LoadedModel | None = None) -> JobSummary:
    """Run one job to completion; raises BatchgenError subclasses for user mistakes."""
    config.validate()
    source = RowSource.open(config)  # every input problem surfaces here, before any output
    out_dir = Path(config.output)
    _refuse_previous_output(out_dir)
    if loaded is None:
        loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                            trust_remote_code=config.trust_remote_code)
    created = not out_dir.exists()
    try:
        job = _Job(config, source, loaded, out_dir)
    except BaseException:
        if created and out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed start leaves no empty directory behind
        raise
    check_output_dir(out_dir)
    cleanup_temp_files(out_dir)
    summary = job.run()
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    rate = config.max_error_rate
    if rate is not None and summary.num_rows and summary.num_rows_error / summary.num_rows > rate:
        raise ErrorRateExceeded(f"{summary.num_rows_error} of {summary.num_rows} rows failed, more than "
                                f"--max-error-rate {rate}; the output is in {out_dir}")
    return summary


def _refuse_previous_output(out_dir: Path) -> None:
    if out_dir.is_dir() and any(p.suffix == ".parquet" for p in out_dir.iterdir()):
        raise OutputError(f"{out_dir} already holds output parts; choose a new --output directory")
