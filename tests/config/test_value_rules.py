"""Each setting's own values are one table (config/rules.py VALUES): every row names a JobConfig field, and a
bad value gets the message that row words, the same one whatever the setting's family."""

from __future__ import annotations

import pytest

from batchgen.config.job import JobConfig
from batchgen.config.rules import VALUES
from batchgen.errors import ConfigError


def test_every_row_is_a_setting():
    assert set(VALUES) <= JobConfig.field_names()


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("max_new_tokens", 0, "--max-new-tokens (YAML max_new_tokens) must be a positive integer, got 0"),
    ("read_batch_size", True, "read_batch_size must be a positive integer, got True"),
    ("commit_every_s", -1, "--commit-every-seconds (YAML commit_every_seconds) must be a number of seconds >= 0 "
                           "(0 = off), got -1"),
    ("ray_keep_warm_s", "x", "--ray-keep-warm (YAML ray_keep_warm) must be a number of seconds >= 0, got 'x'"),
    ("static_min_occupancy", float("nan"), "must be a number in [0, 1], got nan"),
    ("top_k", -2, "--top-k (YAML top_k) must be >= 1, or -1 / 0 for no limit; got -2"),
    ("temperature", float("nan"), "--temperature (YAML temperature) must be a finite number >= 0, got nan"),
    ("temperature", float("inf"), "--temperature (YAML temperature) must be a finite number >= 0, got inf"),
    ("mode", "fast", "--mode (YAML mode) must be one of auto, continuous, static; got 'fast'"),
    ("cuda_graphs", 1, "--cuda-graphs (YAML cuda_graphs) must be true or false, got 1"),
    ("n", 129, "--n (YAML n) must be an integer in [1, 128] (samples per row), got 129"),
    ("logprobs", 21, "must be an integer in [0, 20] (the alternatives listed per token; unset = off), got 21"),
    ("metrics_port", 70000, "must be a port number 0-65535 (0 = any free port), got 70000"),
])
def test_a_bad_value_is_named_as_its_row_words_it(setting, value, message):
    with pytest.raises(ConfigError) as e:
        JobConfig(inputs=["x.parquet"], output="out", **{setting: value}).validate()
    assert str(e.value).endswith(message), str(e.value)


@pytest.mark.parametrize(("setting", "value"), [
    ("batch_size", None), ("workers", None), ("logprobs", None), ("commit_every_s", 0), ("top_k", None),
])
def test_unset_passes_where_the_row_allows_it(setting, value):
    JobConfig(inputs=["x.parquet"], output="out", **{setting: value}).validate()
