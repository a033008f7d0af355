"""One input row of an embed, score or classify job -> its encoder input, and its result -> output rows.

The prompt is built as a generation prompt is (--prompt-column, --template for an instruction
prefix, the cut of a long document per --on-long-prompt and --max-prompt-tokens), by a builder
sized for the encoder's input limit (EncodeModel.max_input_tokens: sentence-transformers'
max_seq_length, else the model's positions) with no room kept for output. The tokenizer adds its
special tokens as sentence-transformers' own tokenizer call does ([CLS] ... [SEP], a decoder's EOS).

score with --score-column: the column's text is the continuation whose log-likelihood is scored;
the prompt before it is cut first where the two do not fit.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.config.text_settings import chat_template_text
from batchgen.io.store.schema import PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX
from batchgen.jobs.openai.requests import prepare_request_row
from batchgen.jobs.prompting.prompts import PromptBuilder, RowError, Template
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.rows import InputRow

if TYPE_CHECKING:  # prompt_check prepares rows before torch is imported
    from batchgen.engine.encode.encoder import EncodeResult

EMBED, SCORE, CLASSIFY = "embed", "score", "classify"


def encode_prompt_builder(config: JobConfig, tokenizer, template: Template, max_input_tokens: int) -> PromptBuilder:
    """The job's prompt builder for the encoder: plain text (no chat template unless --chat asks for it
    in a score or classify job, a reward model's shape: its --chat-template and --chat-template-kwargs
    then as a generation job's), no room kept for output tokens. An embed job with --chat was refused
    with the config (config/task_rules.py)."""
    assert not (config.chat and config.task == EMBED), "task_rules refuses --chat with --task embed"
    chat_template = None if config.chat_template is None else chat_template_text(config.chat_template)
    return PromptBuilder(tokenizer, template, system=config.system, chat=bool(config.chat),
                         max_context_tokens=max_input_tokens, on_long_prompt=config.on_long_prompt,
                         max_prompt_tokens=config.max_prompt_tokens, parse_special_tokens=config.parse_special_tokens,
                         chat_template=chat_template, chat_template_kwargs=config.chat_template_kwargs)


def prepare_encode_row(row: InputRow, builder: PromptBuilder, config: JobConfig) -> PlannedRow:
    """Token ids of one row's input(s); raises RowError for an error row."""
    if config.input_format == OPENAI_BATCH:  # an embeddings request line (batchgen.jobs.openai.requests)
        return prepare_request_row(row, builder, config)
    if row.messages is not None:
        raise RowError(f"column {config.prompt_column!r} holds chat messages; a {config.task} job reads text "
                       "(set --template to build the text from columns)", column=config.prompt_column)
    if config.score_column is None:
        prompt = builder.build(row.values, 0)
        return PlannedRow(row, prompt.token_ids, 0, prompt.num_truncated_tokens)
    text = Template(None, config.score_column).render(row.values)  # null, empty, non-text: this row's error
    continuation = builder.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(continuation) >= builder.max_context_tokens:
        raise RowError(f"column {config.score_column!r} has {len(continuation)} tokens; the model reads at most "
                       f"{builder.max_context_tokens}, leaving no room for the prompt", column=config.score_column)
    prompt = builder.build(row.values, len(continuation))  # the prompt is cut, never the scored text
    ids = list(prompt.token_ids) + list(continuation)
    # where the scored text begins is part of the row's hash: the same ids split elsewhere score otherwise
    return PlannedRow(row, ids, 0, prompt.num_truncated_tokens, score_from=len(prompt.token_ids),
                      settings_key=json.dumps({"score_from": len(prompt.token_ids)}))


def task_columns(task: str, result: EncodeResult | None) -> dict[str, Any]:
    """The task's own output columns of one result (all null for an error row)."""
    if task == EMBED:
        return {"embedding": None if result is None else np.asarray(result.embedding, dtype=np.float32)}
    if task == SCORE:
        from batchgen.engine.encode.score import perplexity  # torch: only once a result exists

        if result is None:
            return {"logprob": None, "num_scored_tokens": None, "perplexity": None}
        n = result.num_scored_tokens
        return {"logprob": result.logprob, "num_scored_tokens": n, "perplexity": perplexity(result.logprob, n)}
    assert task == CLASSIFY, task
    if result is None:
        return {"label": None, "scores": None}
    return {"label": result.label, "scores": np.asarray(result.scores, dtype=np.float32)}


def encode_output_row(task: str, id_name: str, passthrough: list[str], names: frozenset[str], row: InputRow, *,
                      result: EncodeResult | None = None, sample_index: int | None = None,
                      error: str | None = None, digest: str | None = None,
                      truncated: bool | None = None) -> dict[str, Any]:
    """One output row of an encode job (`names`: the schema's column names; a directory begun without
    prompt_hash / prompt_truncated / sample_index keeps its schema)."""
    out: dict[str, Any] = {id_name: row.row_id}
    if SAMPLE_INDEX in names:
        out[SAMPLE_INDEX] = None if result is None else sample_index
    out.update(task_columns(task, result))
    out["num_prompt_tokens"] = None if result is None else result.num_prompt_tokens
    out["error"] = error
    if PROMPT_HASH in names:
        out[PROMPT_HASH] = digest
    if PROMPT_TRUNCATED in names:
        out[PROMPT_TRUNCATED] = None if result is None else bool(truncated)
    for name in passthrough:
        out[name] = row.values.get(name)
    return out
