"""Which settings mean something for which `--task`, and the refusal of the rest before any load.

Only generate decodes: embed, score and classify run one forward pass per row, so a sampling,
decoding or constraint setting given with them would be silently ignored while the user believes
it shaped the output. The generation-only settings are derived, not listed: every setting the
registry says decides a row's output is generation's unless it is declared here as read by every
task (SHARED) or by some tasks only (TASK_ONLY). A new sampling setting is therefore refused with
the other tasks from the day it is added; a new setting the other tasks do read must be declared
in SHARED, or their jobs refuse it (tests/config/test_task_rules.py runs each task on defaults).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

from batchgen.config.choices import POOLINGS, TASKS, Task
from batchgen.config.keys import label
from batchgen.config.settings_registry import deciding_settings
from batchgen.errors import ConfigError

if TYPE_CHECKING:
    from batchgen.config.job import JobConfig

# deciding settings every task reads: which rows, which text (prompt, template), which model,
# how long prompts are cut, which shard
SHARED = frozenset({
    "task", "input_format", "model", "prompt_column", "id_column", "template", "parse_special_tokens", "dtype",
    "num_shards", "on_long_prompt", "max_prompt_tokens",
})
# the chat template's settings: generation, and score and classify (a reward model reads the conversation
# as the chat template renders it); an embedding model reads plain text (an instruction goes in --template)
_CHAT_TASKS = frozenset({Task.GENERATE, Task.SCORE, Task.CLASSIFY})
# deciding settings of some tasks only
TASK_ONLY: dict[str, frozenset[Task]] = {
    "pooling": frozenset({Task.EMBED}),
    "normalize": frozenset({Task.EMBED}),
    "dimensions": frozenset({Task.EMBED}),
    "score_column": frozenset({Task.SCORE}),
    "chat": _CHAT_TASKS,
    "system": _CHAT_TASKS,
    "chat_template": _CHAT_TASKS,
    "chat_template_kwargs": _CHAT_TASKS,
}
# values that switch a setting off, asking of a task that does not read it what it does anyway (--no-chat)
_OFF = {"chat": False}


def tasks_of(name: str) -> frozenset[Task]:
    """The tasks for which setting `name` means something."""
    if name in TASK_ONLY:
        return TASK_ONLY[name]
    if name in SHARED or name not in deciding_settings():
        return frozenset(Task)
    return frozenset({Task.GENERATE})


def generation_only_settings() -> list[str]:
    """The settings only generation reads (sampling, decoding, constraints, quantized decoding, KV cache dtype)."""
    return [name for name in deciding_settings() if tasks_of(name) == frozenset({Task.GENERATE})]


def task_settings(config: JobConfig) -> None:
    """Refuse (ConfigError, exit 2) a setting given off its default that the job's task does not read,
    naming its flag; check the task's own settings' values."""
    if config.task not in TASKS:
        raise ConfigError(f"{label('task')} must be one of {', '.join(TASKS)}; got {config.task!r}")
    task = Task(config.task)
    for f in fields(config):
        value = getattr(config, f.name)
        if task in tasks_of(f.name) or value == _default(f) or (f.name in _OFF and value is _OFF[f.name]):
            continue
        allowed = sorted(t.value for t in tasks_of(f.name))
        if allowed == [Task.GENERATE.value]:
            raise ConfigError(f"{label(f.name)} is a generation setting, and --task {task} generates no text "
                              f"(one forward pass per row): drop it")
        raise ConfigError(f"{label(f.name)} applies to --task {' or '.join(allowed)} only, not --task {task}")
    if config.pooling is not None and config.pooling not in POOLINGS:
        raise ConfigError(f"{label('pooling')} must be one of {', '.join(POOLINGS)}; got {config.pooling!r}")
    if config.normalize is not None and not isinstance(config.normalize, bool):
        raise ConfigError(f"{label('normalize')} must be true or false (unset: the model's), got {config.normalize!r}")
    if config.dimensions is not None and (isinstance(config.dimensions, bool) or not isinstance(config.dimensions, int)
                                          or config.dimensions < 1):
        raise ConfigError(f"{label('dimensions')} must be an integer >= 1 (unset: all of the model's), "
                          f"got {config.dimensions!r}")
    if config.score_column is not None and (not isinstance(config.score_column, str) or not config.score_column):
        raise ConfigError(f"{label('score_column')} must be a column name, got {config.score_column!r}")


def _default(f: Any) -> Any:
    return f.default_factory() if f.default is MISSING else f.default
