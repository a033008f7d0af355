"""Is a finished --id-column job's rerun "nothing to do"? Decided with the tokenizer alone.

Under --id-column a committed row is settled only while its prompt is unchanged
(batchgen.jobs.durability.resume), so telling a finished job from a changed one means building every row's
prompt again and comparing its hash with the committed one. That needs the tokenizer and the
model's context length, never its weights: loading those to print "done: 0 rows" cost the
whole model load.

Prompts are built against the model's full context here, where the run builds them against its
engine's (never longer). A row whose prompt fits both hashes the same either way; one that was
cut to fit may hash differently here, and then the run loads the model and decides with its
engine, as it always did: this check can only say "unchanged" where the run would agree.

The model is compared the same way, before it loads: the committed rows are settled only while its
files are those a run that loaded it recorded (batchgen.engine.model.model_files). Files that differ
(another checkpoint at the same path, another --model or --dtype, or the same model copied anew)
send the rerun to the load, where the fingerprint's content hash and resolved dtype decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.config.job import JobConfig
from batchgen.errors import BatchgenError
from batchgen.io.manifest.manifest import ManifestState
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.encoding.encode_rows import encode_prompt_builder, prepare_encode_row
from batchgen.jobs.encoding.task_setup import is_encode_task
from batchgen.jobs.planning.planner import prepare_row
from batchgen.jobs.prompting.prompts import PromptBuilder, RowError

if TYPE_CHECKING:
    from batchgen.jobs.pipeline.prepare import JobInputs


def nothing_to_do(config: JobConfig, inputs: JobInputs, resume: ResumeRule, model_files: dict[str, Any]) -> bool:
    """A rerun that needs no model: the model's files (`model_files`: model_files_identity) are those
    the committed rows were generated with, and every input row is settled."""
    return model_files_unchanged(resume.state, model_files) and (
        resume.nothing_to_do(inputs) or prompts_unchanged(config, inputs, resume))


def model_files_unchanged(state: ManifestState, model_files: dict[str, Any]) -> bool:
    """Whether the last run that recorded its inputs had the same model files. A directory whose
    runs recorded none (begun by a batchgen before it) is trusted, as it was then."""
    recorded = (state.inputs or {}).get("model_files", model_files)
    return recorded == model_files


def prompts_unchanged(config: JobConfig, inputs: JobInputs, resume: ResumeRule) -> bool:
    """True when every input row is settled once committed prompts are compared: a run would
    generate nothing. Loads the tokenizer (batchgen.engine.model.loader.load_tokenizer: imports torch,
    reads no weights) only when every row left unsettled by id has a committed hash to compare."""
    if not resume.check_prompts or not resume.state.num_committed_rows \
            or resume.num_rows_done < inputs.scan.num_rows:
        return False
    builder: PromptBuilder | None = None
    for row, committed_hash in resume.unsettled_rows(inputs.source):
        if committed_hash is None or row.error is not None:
            return False  # a row never committed, or one that is now an error row: there is work
        if builder is None:  # the first row to compare: now the tokenizer is worth loading
            builder = _builder(config, inputs)
            if builder is None:
                return False
        try:
            if _prepare(row, builder, config).prompt_hash != committed_hash:
                return False
        except RowError:  # it would become an error row now
            return False
    return True


def _builder(config: JobConfig, inputs: JobInputs) -> PromptBuilder | None:
    """The run's prompt builder over the model's tokenizer and full context; None where the
    tokenizer alone cannot be had or the builder refuses the settings (the run then reports it)."""
    from batchgen.engine.model.loader import load_tokenizer  # imports torch: only a rerun that compares prompts

    found = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    if found is None:
        return None
    tokenizer, max_context_tokens = found
    try:
        if is_encode_task(config):  # cut at the model's context: its encoder never reads more
            return encode_prompt_builder(config, tokenizer, inputs.source.template, max_context_tokens)
        return PromptBuilder.for_job(config, tokenizer, inputs.source.template, max_context_tokens)
    except BatchgenError:
        return None


def _prepare(row, builder: PromptBuilder, config: JobConfig):
    """The row as the run prepares it: an encoder's input for embed / score / classify."""
    return prepare_encode_row(row, builder, config) if is_encode_task(config) else prepare_row(row, builder, config)
