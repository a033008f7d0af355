"""--task: generation's settings are refused with the other tasks (exit 2, naming the flag, before any
load), embed-only and score-only settings with the wrong task likewise, and the tasks' own values are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.config.choices import Task
from batchgen.config.job import build_config
from batchgen.config.task_rules import generation_only_settings, tasks_of
from batchgen.errors import ConfigError

REQUIRED = dict(inputs=["in.parquet"], output="out")
ROOT = Path(__file__).resolve().parents[2]

# the settings only generation reads: sampling, decoding, stopping, constraints, generated-token
# logprobs, samples per row, quantized decoding and the KV cache's dtype
GENERATION_ONLY = {
    "max_new_tokens": 8, "max_new_tokens_column": "budget", "temperature": 0.7, "top_p": 0.9, "top_k": 5,
    "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 2, "min_p": 0.1,
    "stop_token_ids": [5], "logit_bias": {5: 1.0}, "allowed_token_ids": [5, 6], "include_stop_str_in_output": True,
    "skip_special_tokens": False, "logprobs": 2, "n": 2, "sampling_column": "s", "json_schema": '{"type": "object"}',
    "regex": "[ab]+", "choices": ["a", "b"], "json_schema_column": "schema", "constraint_column": "c", "seed": 7,
    "stop": ["x"], "ignore_eos": True, "quantize": "int8", "quantize_backend": "quanto",
    "quantize_embedding": "int8", "kv_cache_dtype": "int8", "lora": {"a": "adapter_dir"}, "lora_column": "adapter",
}

# the settings a setting is only valid beside (--lora-column names rows' --lora adapters)
WITH = {"lora_column": {"lora": GENERATION_ONLY["lora"]}}


def test_the_generation_only_settings_are_these():
    """Derived from the registry: a deciding setting not declared as read by other tasks is generation's."""
    assert sorted(generation_only_settings()) == sorted(GENERATION_ONLY)


@pytest.mark.parametrize("task", ["embed", "score", "classify"])
@pytest.mark.parametrize("name", sorted(GENERATION_ONLY))
def test_a_generation_setting_with_another_task_is_refused_naming_it(task, name):
    given = {name: GENERATION_ONLY[name], **WITH.get(name, {})}
    named = "|".join(n.replace("_", "-") for n in given)  # the first generation setting found is named
    with pytest.raises(ConfigError, match=f"--({named}) .*generation setting.*--task {task}") as e:
        build_config(None, **REQUIRED, task=task, **given)
    assert e.value.exit_code == 2
    build_config(None, **REQUIRED, **given)  # generate takes it


@pytest.mark.parametrize("task", [t.value for t in Task])
def test_every_task_runs_on_the_defaults_and_the_default_yaml(task):
    """A default value is not "given": the defaults, and configs/default.yaml (every setting at its
    default), validate with each task."""
    assert build_config(None, **REQUIRED, task=task).task == task
    assert build_config(ROOT / "configs" / "default.yaml", **REQUIRED, task=task).task == task


@pytest.mark.parametrize(("name", "value", "task", "match"), [
    ("pooling", "mean", "score", "--pooling .*applies to --task embed only, not --task score"),
    ("normalize", False, "generate", "--normalize .*applies to --task embed only, not --task generate"),
    ("dimensions", 64, "classify", "--dimensions .*applies to --task embed only"),
    ("score_column", "answer", "embed", "--score-column .*applies to --task score only, not --task embed"),
])
def test_a_task_own_setting_with_the_wrong_task_is_refused(name, value, task, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, **REQUIRED, task=task, **{name: value})


@pytest.mark.parametrize(("values", "match"), [
    (dict(task="summarize"), "--task .*must be one of generate, embed, score, classify"),
    (dict(task="embed", pooling="max"), "--pooling .*must be one of mean, cls, last"),
    (dict(task="embed", dimensions=0), "--dimensions .*integer >= 1"),
    (dict(task="embed", dimensions="64"), "--dimensions .*integer >= 1"),
    (dict(task="embed", normalize="yes"), "--normalize .*true or false"),
])
def test_bad_task_values_are_refused(values, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, **REQUIRED, **values)


def test_the_task_settings_validate():
    config = build_config(None, **REQUIRED, task="embed", pooling="cls", normalize=False, dimensions=32)
    assert (config.task, config.pooling, config.normalize, config.dimensions) == ("embed", "cls", False, 32)
    assert build_config(None, **REQUIRED, task="score", score_column="answer").score_column == "answer"
    assert tasks_of("template") == frozenset(Task)  # instruction prefixes work for every task


@pytest.mark.parametrize(("name", "value"), [
    ("chat", True), ("system", "Be brief."), ("chat_template", "{{ messages[0].content }}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
])
def test_the_chat_settings_with_embed_are_refused_at_config(name, value):
    """An embedding model reads plain text: the chat template's settings are refused with the config,
    before any load (exit 2, naming the flag); score and classify (a reward model's conversation) take them."""
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} .*applies to --task classify or generate or "
                                          f"score only, not --task embed") as e:
        build_config(None, **REQUIRED, task="embed", **{name: value})
    assert e.value.exit_code == 2
    for task in ("score", "classify", "generate"):
        assert getattr(build_config(None, **REQUIRED, task=task, **{name: value}), name) == value


def test_no_chat_with_embed_asks_for_what_embed_does():
    assert build_config(None, **REQUIRED, task="embed", chat=False).chat is False
