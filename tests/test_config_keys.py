"""One source for option names: every `run`/`plan` flag is a YAML key of the same
name in snake_case, reaching the same JobConfig field; vLLM's max_tokens works in both; an
unknown key says which known one it is likely to be."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.cli.options import NOT_CONFIG, config_overrides
from batchgen.config.job import KEY_ALIASES, JobConfig, build_config, load_config_file
from batchgen.errors import ConfigError

NOT_SETTINGS = {"--config", "--help", "--calibrate", "--calibration-rows", "--json"}  # what a command does, not the job


def command_options(name: str):
    command = typer.main.get_command(app).commands[name]
    return [p for p in command.params if p.param_type_name == "option"]


def yaml_key(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


@pytest.mark.parametrize("command", ["run", "plan"])
def test_every_flag_is_a_yaml_key_of_its_field(command, tmp_path):
    fields = JobConfig.field_names()
    for option in command_options(command):
        flags = [f for f in option.opts if f.startswith("--")]
        if set(flags) & NOT_SETTINGS:
            assert option.name in NOT_CONFIG, option.name
            continue
        # the parameter reaches one JobConfig field
        (field,) = config_overrides({option.name: "x"})
        assert field in fields, (option.name, field)
        for flag in flags:  # --max-new-tokens and its alias --max-tokens alike
            key = yaml_key(flag)
            assert KEY_ALIASES.get(key, key) == field, (flag, field)
            path = tmp_path / "job.yaml"
            path.write_text(f"{key}: null\n")
            assert load_config_file(path) == {field: None}, flag


@pytest.mark.parametrize(("text", "field", "value"), [
    ("commit_every: 7\n", "commit_every_rows", 7),
    ("commit_every_seconds: 5\n", "commit_every_s", 5),
    ("stop-grace-seconds: 3\n", "stop_grace_s", 3),
    ("metrics_every_seconds: 2\n", "metrics_every_s", 2),
    ("checkpoint_in_flight_every: 9\n", "checkpoint_in_flight_every_s", 9),
    ("ray_keep_warm: 30\n", "ray_keep_warm_s", 30),
    ("max_tokens: 12\n", "max_new_tokens", 12),
    ("workers: 3\n", "workers", 3),
    ("commit_every_s: 5\n", "commit_every_s", 5),  # the field's own name still works
])
def test_flag_names_as_yaml_keys(tmp_path, text, field, value):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    config = build_config(path, inputs=["x.parquet"], output=str(tmp_path / "out"))
    assert getattr(config, field) == value


def test_one_setting_under_two_keys_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("max_tokens: 5\nmax_new_tokens: 6\n")
    with pytest.raises(ConfigError, match="'max_tokens' and 'max_new_tokens' are the same setting"):
        load_config_file(path)


@pytest.mark.parametrize(("key", "suggestion"), [
    ("temprature", "temperature"), ("max_new_token", "max_new_tokens"), ("stop_grace", "stop_grace_s"),
])
def test_unknown_key_suggests_the_close_one(tmp_path, key, suggestion):
    path = tmp_path / "job.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    message = str(e.value)
    assert f"unknown setting {key!r}; did you mean {suggestion!r}?" in message
    assert message.count(",") < 3  # not the list of every known key


def test_unknown_key_with_nothing_close(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("zzzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'zzzz' \(configs/default.yaml lists every setting\)"):
        load_config_file(path)


def test_workers_below_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--workers \(YAML workers\) must be a positive integer, got 0"):
        build_config(None, inputs=["x.parquet"], output=str(tmp_path / "out"), workers=0)


def test_cli_max_tokens_and_yaml_workers_reach_the_job(tmp_path, monkeypatch):
    import batchgen.jobs.commands.run as job_run
    import batchgen.jobs.executors.workers as job_workers

    seen = {}

    def fake_workers(config, num_workers):
        seen["config"], seen["workers"] = config, num_workers
        raise ConfigError("stopped here")

    monkeypatch.setattr(job_workers, "run_workers", fake_workers)
    monkeypatch.setattr(job_run, "run_job", lambda config: fake_workers(config, None))
    path = tmp_path / "job.yaml"
    path.write_text("workers: 2\n")
    argv = ["run", "-i", "x.parquet", "-o", str(tmp_path / "out"), "--max-tokens", "7"]
    result = CliRunner().invoke(app, [*argv, "--config", str(path)])
    assert result.exit_code == 2 and "stopped here" in result.output, result.output
    assert (seen["workers"], seen["config"].max_new_tokens) == (2, 7)
    CliRunner().invoke(app, argv)
    assert seen["workers"] is None  # no workers: one process


def test_settings_without_a_flag_are_exactly_no_flag():
    from batchgen.config.rules import NO_FLAG

    flagged = set()
    for command in ("run", "plan"):
        for option in command_options(command):
            if option.name not in NOT_CONFIG:
                flagged |= set(config_overrides({option.name: "x"}))
    assert JobConfig.field_names() - flagged == NO_FLAG


@pytest.mark.parametrize("off", ["0", "-1"])
def test_top_k_minus_one_and_zero_mean_off(tmp_path, monkeypatch, off):
    """vLLM's top_k=-1 is "no limit": accepted on the command line, in YAML and in a sampling cell."""
    import batchgen.jobs.commands.run as job_run
    from batchgen.jobs.rows.row_sampling import row_sampling

    seen = {}

    def fake_run_job(config):
        seen["config"] = config
        raise ConfigError("stopped here")

    monkeypatch.setattr(job_run, "run_job", fake_run_job)
    result = CliRunner().invoke(app, ["run", "-i", "x.parquet", "-o", str(tmp_path / "out"), "--top-k", off])
    assert seen["config"].top_k is None, result.output
    path = tmp_path / "job.yaml"
    path.write_text(f"top_k: {off}\n")
    assert build_config(path, inputs=["x"], output="o").top_k is None
    assert row_sampling({"s": f'{{"top_k": {off}}}'}, "s") == {"top_k": None}
