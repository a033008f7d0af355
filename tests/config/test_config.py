"""JobConfig: defaults < config file < overrides, size parsing, and one clear message per bad value."""

from __future__ import annotations

import pytest

from batchgen.config.job import JobConfig, build_config, load_config_file, parse_bytes
from batchgen.errors import ConfigError

REQUIRED = dict(inputs=["in.parquet"], output="out")


def _yaml(tmp_path, text: str, name: str = "job.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- precedence


def test_defaults_apply_when_nothing_is_given():
    config = build_config(None, **REQUIRED)
    defaults = JobConfig()
    assert config.max_new_tokens == defaults.max_new_tokens == 256
    assert config.mode == "auto"  # the length planner chooses per window
    assert config.prompt_column == "text"
    assert config.inputs == ["in.parquet"]


def test_file_overrides_defaults_and_flags_override_file(tmp_path):
    path = _yaml(tmp_path, "input: a.parquet\noutput: out_from_file\nmax_new_tokens: 7\n"
                           "temperature: 0.5\nprompt_column: body\nmode: static\n")
    config = build_config(path, max_new_tokens=3, mode=None, temperature=None)
    assert config.max_new_tokens == 3  # flag beats file
    assert config.temperature == 0.5  # None = flag not given: the file's value stays
    assert config.mode == "static"
    assert config.prompt_column == "body"  # file beats default
    assert config.top_p == 1.0  # neither: default
    assert config.inputs == ["a.parquet"] and config.output == "out_from_file"


def test_empty_list_override_keeps_the_file_value(tmp_path):
    # Typer passes [] or None for a repeatable flag that was not given
    path = _yaml(tmp_path, "inputs: [a.parquet, b.jsonl]\noutput: out\nstop: END\n")
    config = build_config(path, inputs=[], stop=None)
    assert config.inputs == ["a.parquet", "b.jsonl"]
    assert config.stop == ["END"]  # a single string becomes a list
    config = build_config(path, inputs=("c.parquet",))
    assert config.inputs == ["c.parquet"]


def test_yaml_keys_may_use_dashes(tmp_path):
    path = _yaml(tmp_path, "inputs: a.parquet\noutput: out\nmax-new-tokens: 9\nkv-cache-memory: 64MiB\n")
    config = build_config(path)
    assert config.max_new_tokens == 9
    assert config.kv_cache_memory == "64MiB"


def test_yaml_single_strings_become_lists(tmp_path):
    path = _yaml(tmp_path, "inputs: a.parquet\noutput: out\nstop: END\nkeep_columns: title\n")
    config = build_config(path)
    assert config.inputs == ["a.parquet"]
    assert config.stop == ["END"]
    assert config.keep_columns == ["title"]  # not ['t', 'i', 't', 'l', 'e']


def test_empty_yaml_means_defaults(tmp_path):
    assert load_config_file(_yaml(tmp_path, "")) == {}
    assert build_config(_yaml(tmp_path, "# nothing\n"), **REQUIRED).max_new_tokens == 256


# ---------------------------------------------------------------- parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("16 MiB", 16 * 2**20), ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000), ("64kb", 64_000), ("3KiB", 3 * 1024), ("10b", 10), ("2gib", 2 * 2**30),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "GiB", "0", "-1GiB", "5TB", "1.2.3MiB", "12 parsecs"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError, match=r"--kv-cache-memory \(YAML kv_cache_memory\): cannot read"):
        parse_bytes(text)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("changes", "message"), [
    (dict(inputs=[]), "no input given"),
    (dict(output=None), "no output directory given"),
    (dict(max_new_tokens=0), r"--max-new-tokens \(YAML max_new_tokens\) must be a positive integer, got 0"),
    (dict(max_new_tokens=-5), r"--max-new-tokens \(YAML max_new_tokens\) must be a positive integer, got -5"),
    (dict(batch_size=0), r"--batch-size \(YAML batch_size\) must be a positive integer"),
    (dict(max_num_batched_tokens=-1),
     r"--max-num-batched-tokens \(YAML max_num_batched_tokens\) must be a positive integer"),
    (dict(rows_per_part=0), r"--rows-per-part \(YAML rows_per_part\) must be a positive integer"),
    (dict(max_rows=-1), r"--max-rows \(YAML max_rows\) must be >= 0"),
    (dict(temperature=-0.1), r"--temperature \(YAML temperature\) must be a finite number >= 0"),
    (dict(top_p=0.0), r"--top-p \(YAML top_p\) must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"--top-p \(YAML top_p\) must be in \(0, 1\]"),
    (dict(top_k=-5), r"--top-k \(YAML top_k\) must be >= 1, or -1 / 0 for no limit; got -5"),
    (dict(mode="fast"), r"--mode \(YAML mode\) must be one of auto, continuous, static; got 'fast'"),
    (dict(device="tpu"), r"--device \(YAML device\) must be one of auto, cpu, cuda"),
    (dict(dtype="int4"), r"--dtype \(YAML dtype\) must be one of auto, float32, bfloat16, float16"),
    (dict(on_long_prompt="skip"), r"--on-long-prompt \(YAML on_long_prompt\) must be one of truncate, error"),
    (dict(stop=["END", ""]), r"--stop \(YAML stop\): a stop string must not be empty"),
    (dict(kv_cache_memory="lots"), r"--kv-cache-memory \(YAML kv_cache_memory\): cannot read 'lots'"),
    (dict(logit_bias="{5: 1}"), r"--logit-bias \(YAML logit_bias\): not valid JSON"),
    (dict(logit_bias='{"5": 101}'), r"--logit-bias \(YAML logit_bias\): the bias of token 5 must be a number in "
                                    r"\[-100, 100\]"),
    (dict(logit_bias='{"x": 1}'), r"--logit-bias \(YAML logit_bias\): 'x' is not a token id"),
    (dict(allowed_token_ids=[3, -1]), r"--allowed-token-ids \(YAML allowed_token_ids\) must be token ids"),
])
def test_validation_messages(changes, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, **{**REQUIRED, **changes})


def test_unknown_override_is_a_config_error():
    with pytest.raises(ConfigError, match="max_tokens"):
        build_config(None, max_tokens=5, **REQUIRED)


@pytest.mark.parametrize(("text", "message"), [
    ("max_new_tokens: ten\n", r"--max-new-tokens \(YAML max_new_tokens\) must be a number, got 'ten'"),
    ("max_new_tokens: true\n", r"--max-new-tokens \(YAML max_new_tokens\) must be a number, got True"),
    ("temperature: hot\n", r"--temperature \(YAML temperature\) must be a number"),
    ("top_p: [1]\n", r"--top-p \(YAML top_p\) must be a number"),
    ("seed: 1.5\n", r"--seed \(YAML seed\) must be a number"),
    ("top_k: '40'\n", r"--top-k \(YAML top_k\) must be an integer or unset, got '40'"),
    ("max_rows: '100'\n", r"--max-rows \(YAML max_rows\) must be an integer or unset"),
    ("top_k: 2.5\n", r"--top-k \(YAML top_k\) must be an integer or unset, got 2.5"),
    ("max_rows: 1.5\n", r"--max-rows \(YAML max_rows\) must be an integer"),
    ("max_error_rate: '0.1'\n", r"--max-error-rate \(YAML max_error_rate\) must be a number"),
    ("mode: 3\n", r"--mode \(YAML mode\) must be one of"),
])
def test_wrong_types_in_yaml_are_config_errors(tmp_path, text, message):
    """A quoted number or a word where a number belongs is the user's mistake, never a TypeError."""
    path = _yaml(tmp_path, "inputs: a.parquet\noutput: out\n" + text)
    with pytest.raises(ConfigError, match=message):
        build_config(path)


def test_unknown_yaml_key_names_the_likely_one(tmp_path):
    path = _yaml(tmp_path, "inputs: a.parquet\nmax_new_token: 5\n")
    with pytest.raises(ConfigError) as info:
        build_config(path)
    message = str(info.value)
    assert "unknown setting 'max_new_token'; did you mean 'max_new_tokens'?" in message
    assert str(path) in message
    assert "\n" not in message


def test_invalid_yaml_is_one_line(tmp_path):
    path = _yaml(tmp_path, "inputs: [a.parquet\nmax_new_tokens: 5\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        build_config(path)
    assert "\n" not in str(info.value)


def test_yaml_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping of settings, got list"):
        build_config(_yaml(tmp_path, "- a\n- b\n"))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        build_config(tmp_path / "nope.yaml")


def test_validate_returns_self_and_replace_revalidates():
    config = build_config(None, **REQUIRED)
    assert config.validate() is config
    with pytest.raises(ConfigError, match="top_p"):
        config.replace(top_p=0).validate()


@pytest.mark.parametrize("output_format", ["openai-batch", "both"])
def test_object_store_output_takes_the_batch_api_files(output_format):
    config = build_config(None, **{**REQUIRED, "output": "s3://bucket/prefix", "input_format": "openai-batch",
                                   "output_format": output_format})
    assert config.output_format == output_format


def test_object_store_output_takes_a_shard_of_a_sharded_job():
    config = build_config(None, **{**REQUIRED, "output": "s3://bucket/prefix", "num_shards": 2, "shard_index": 1})
    assert (config.num_shards, config.shard_index) == (2, 1)


@pytest.mark.parametrize("changes", [dict(num_shards=2, shard_index=1), dict(output="s3://bucket/prefix"),
                                     dict(input_format="openai-batch", output_format="both")])
def test_ray_executor_takes_shards_object_stores_and_batch_requests(changes):
    config = build_config(None, **{**REQUIRED, "executor": "ray", **changes})
    assert config.executor == "ray"


def test_token_controls_read_from_yaml_with_string_or_integer_ids(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text('logit_bias: {"198": -100, 5: 2.5}\nallowed_token_ids: 7\n')
    config = build_config(path, **REQUIRED)
    assert config.logit_bias == {5: 2.5, 198: -100.0} and config.allowed_token_ids == [7]


def test_choices_refuse_min_tokens():
    """A row ends once its text is one of the choices: --min-tokens could never lengthen it."""
    with pytest.raises(ConfigError, match="--choices .* and --min-tokens .* cannot go together"):
        build_config(None, **REQUIRED, choices="yes,no", min_tokens=6)
    assert build_config(None, **REQUIRED, choices="yes,no", min_tokens=0).choices == ["yes", "no"]
    assert build_config(None, **REQUIRED, regex="a+", min_tokens=6).min_tokens == 6  # a regex may go on
