"""Every JobConfig field is declared as deciding a row's output or not, and the fingerprint follows
the declarations: the class of "a setting recorded only when set that a resume may drop" is closed."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.config.settings_registry import (
    ALWAYS,
    DERIVED_KEYS,
    SETTINGS,
    Derived,
    Output,
    absent_value,
    output_settings,
)
from batchgen.jobs.durability.fingerprint import INFO_KEYS, fingerprint_changes, job_fingerprint


def default_config() -> JobConfig:
    return JobConfig(inputs=["in.parquet"], output="out")


def test_every_field_is_declared():
    fields = {f.name for f in dataclasses.fields(JobConfig)}
    missing = sorted(fields - set(SETTINGS))
    assert not missing, (f"JobConfig fields without a declaration in batchgen/config/settings_registry.py: "
                         f"{missing}: say whether each decides a row's output")
    assert not sorted(set(SETTINGS) - fields), "declarations of fields JobConfig no longer has"


def test_declared_defaults_are_the_config_defaults():
    """A default that disagreed with JobConfig's would record (or omit) the setting wrongly."""
    config = default_config()
    for name, setting in output_settings().items():
        if setting.default is not ALWAYS:
            value = getattr(config, name)
            assert (list(value) if isinstance(value, tuple) else value) == setting.default, name


def test_derived_settings_name_declared_keys():
    for name, setting in SETTINGS.items():
        if isinstance(setting, Derived):
            assert setting.keys and all(key in DERIVED_KEYS for key in setting.keys), name


def test_a_default_job_records_only_what_is_always_recorded():
    fingerprint = job_fingerprint(default_config(), None, pa.schema([("id", pa.int64())]))
    always = {n for n, s in output_settings().items() if s.default is ALWAYS}
    assert set(fingerprint) == always | {"output_format", "output_schema", *INFO_KEYS}


def test_absent_keys_compare_as_their_declared_defaults():
    plain = job_fingerprint(default_config(), None, pa.schema([("id", pa.int64())]))
    for name, setting in output_settings().items():
        if setting.default is not ALWAYS:
            assert absent_value(name) == setting.default
            # an older batchgen that wrote the key at its default is the same as one that left it out
            assert fingerprint_changes({**plain, name: setting.default}, plain) == [], name
            assert fingerprint_changes(plain, {**plain, name: setting.default}) == [], name


def test_a_key_this_batchgen_does_not_know_is_refused():
    """A directory begun by a newer batchgen with a setting this one lacks: it cannot honour it."""
    plain = job_fingerprint(default_config(), None, pa.schema([("id", pa.int64())]))
    changes = fingerprint_changes({**plain, "some_future_setting": 3}, plain)
    assert len(changes) == 1 and changes[0].startswith("some_future_setting")


def test_run_only_settings_never_enter_the_fingerprint():
    schema = pa.schema([("id", pa.int64())])
    plain = job_fingerprint(default_config(), None, schema)
    changed = default_config().replace(batch_size=7, kv_cache_memory="1GiB", rows_per_part=3, quiet=True,
                                       max_error_rate=0.5, mode="static", workers=2)
    assert job_fingerprint(changed, None, schema) == plain
    assert all(isinstance(SETTINGS[n], Output | Derived) is False for n in ("batch_size", "quiet", "mode"))
