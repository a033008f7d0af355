"""What the model's context rules out, checked before the model loads (run and plan alike).

A row's prompt gets the model's context minus its max_new_tokens (batchgen.jobs.prompting.prompts):
a job-wide --max-new-tokens that fills the whole context leaves no room for any prompt, so every
row would load the model only to become an error row. The context length comes from the model's
files (batchgen.engine.model.context_length); where they cannot tell it, the prompt builder's own
per-row check still makes each such row an error row.
"""

from __future__ import annotations

from batchgen.config.job import JobConfig
from batchgen.config.rules import label
from batchgen.engine.model.context_length import context_tokens_from_files
from batchgen.errors import ConfigError


def check_room_for_prompts(config: JobConfig) -> None:
    """Raise ConfigError (exit 2) when --max-new-tokens leaves no room for a prompt in the context."""
    context = context_tokens_from_files(config.model)
    if context is None or config.max_new_tokens < context:
        return
    model = config.model or "the embedded default model"
    raise ConfigError(f"{label('max_new_tokens')} {config.max_new_tokens} leaves no room for the prompt in the "
                      f"context of {model} ({context} tokens): every row would fail; use at most {context - 1}")
