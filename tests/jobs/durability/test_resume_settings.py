"""A resume that drops or adds any setting that decides a row's output is refused (exit 2), for every
such setting the registry declares: the class of holes where a setting recorded "only when set" let
a resume mix two configurations in one output, closed for settings added later too."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli.app import app
from batchgen.config.settings_registry import deciding_settings
from batchgen.engine.model.loader import load_model
from batchgen.errors import FingerprintMismatch
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.lora_adapters import make_adapter
from tests.tiny import make_tiny_model

NUM_ROWS = 5
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

# A non-default value of every setting that decides a row's output. A setting added to the registry
# without an example here fails test_every_deciding_setting_has_an_example: add one, and this file
# checks that a resume which drops or adds it is refused.
EXAMPLES = {
    "task": dict(task="score"),
    "pooling": dict(task="embed", pooling="mean"),
    "normalize": dict(task="embed", normalize=False),
    "dimensions": dict(task="embed", dimensions=8),
    "score_column": dict(task="score", score_column="other"),
    "input_format": dict(input_format="parquet"),
    "model": dict(model="OTHER_MODEL"),
    "prompt_column": dict(prompt_column="other"),
    "id_column": dict(id_column="id2"),
    "template": dict(template="Q: {text}"),
    "system": dict(system="Answer briefly."),
    "chat": dict(chat=False),
    "chat_template": dict(chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}"),
    "chat_template_kwargs": dict(chat_template_kwargs={"enable_thinking": False}),
    "parse_special_tokens": dict(parse_special_tokens=True),
    "max_new_tokens": dict(max_new_tokens=2),
    "max_new_tokens_column": dict(max_new_tokens_column="budget"),
    "temperature": dict(temperature=0.7),
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=5),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "min_tokens": dict(min_tokens=2),
    "min_p": dict(min_p=0.1),
    "stop_token_ids": dict(stop_token_ids=[5]),
    "logit_bias": dict(logit_bias={5: 2.0}),
    "allowed_token_ids": dict(allowed_token_ids=list(range(3, 60))),
    "include_stop_str_in_output": dict(include_stop_str_in_output=True),
    "skip_special_tokens": dict(skip_special_tokens=False),
    "logprobs": dict(logprobs=2),
    "n": dict(n=2),
    "sampling_column": dict(sampling_column="sampling"),
    "json_schema": dict(json_schema=SCHEMA),
    "regex": dict(regex="[ab]+"),
    "choices": dict(choices=["yes", "no"]),
    "json_schema_column": dict(json_schema_column="schema"),
    "constraint_column": dict(constraint_column="constraint"),
    "seed": dict(seed=7),
    "stop": dict(stop=["x"]),
    "ignore_eos": dict(ignore_eos=True),
    "dtype": dict(dtype="bfloat16"),
    "quantize": dict(quantize="int8"),
    "quantize_backend": dict(quantize_backend="quanto"),
    "quantize_embedding": dict(quantize_embedding="int8"),
    "kv_cache_dtype": dict(kv_cache_dtype="int8"),
    "num_shards": dict(num_shards=2, shard_index=0),
    "on_long_prompt": dict(on_long_prompt="error"),
    "max_prompt_tokens": dict(max_prompt_tokens=64),
    "lora": dict(lora="ADAPTER"),
    "lora_column": dict(lora="ADAPTER", lora_column="lora_name"),
}
# Checked on the fingerprints alone (tests/config/test_settings_registry.py, test_fingerprint.py):
# a sharded job writes each shard into a directory of its own (shard-I-of-N/), so a run with and one
# without --num-shards never share an output directory to mix; finalize refuses a set that differs.
FINGERPRINT_ONLY = {"num_shards"}


def test_every_deciding_setting_has_an_example():
    assert sorted(EXAMPLES) == sorted(deciding_settings())


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("settings") / "in.parquet"
    texts = [f"row {i} " + "ab" * i for i in range(NUM_ROWS)]
    pq.write_table(pa.table({
        "id": list(range(NUM_ROWS)), "id2": [f"r{i}" for i in range(NUM_ROWS)], "text": texts,
        "other": [t.upper() for t in texts], "budget": [2] * NUM_ROWS,
        "sampling": pa.array([None] * NUM_ROWS, pa.string()), "schema": pa.array([None] * NUM_ROWS, pa.string()),
        "constraint": pa.array([None] * NUM_ROWS, pa.string()),
        "lora_name": pa.array(["a", None] * (NUM_ROWS // 2) + ["a"] * (NUM_ROWS % 2), pa.string())}), path)
    return path


@pytest.fixture(scope="module")
def models(tiny_model_dir, eos_model_dir, loaded, loaded_eos, tmp_path_factory):
    """(model dir, loaded) by the setting's model and dtype: the tiny Llama, another with other weights, bf16;
    and a LoRA adapter of the tiny Llama."""
    bf16 = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    adapter = make_adapter(make_tiny_model("llama"), tmp_path_factory.mktemp("lora") / "a", seed=1, r=4,
                           lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return {(str(tiny_model_dir), "float32"): loaded, (str(eos_model_dir), "float32"): loaded_eos,
            (str(tiny_model_dir), "bfloat16"): bf16, "other": str(eos_model_dir), "tiny": str(tiny_model_dir),
            "adapter": str(adapter)}


def job(src, out, models, **setting):
    if setting.get("model") == "OTHER_MODEL":
        setting["model"] = models["other"]
    if setting.get("lora") == "ADAPTER":
        setting["lora"] = {"a": models["adapter"]}
    generating = setting.get("task", "generate") == "generate"  # the other tasks refuse --max-new-tokens
    defaults = dict(id_column="id", max_new_tokens=3) if generating else dict(id_column="id")
    config = tiny_job_config(src, out, models["tiny"], **{**defaults, **setting})
    # embed and score load their own model for the task (an EncodeModel: pooling, normalization, dimensions)
    return config, models[(config.model, config.dtype)] if generating else None


def refused(src, out, models, setting, name):
    config, loaded = job(src, out, models, **setting)
    with pytest.raises(FingerprintMismatch) as e:
        run_job(config, loaded=loaded)
    assert e.value.exit_code == 2
    assert name in str(e.value) or "model_revision" in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def plain_out(src, models, tmp_path_factory):
    """An output directory with two rows committed under the default settings."""
    out = tmp_path_factory.mktemp("plain") / "out"
    config, loaded = job(src, out, models, max_rows=2)
    run_job(config, loaded=loaded)
    return out


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - FINGERPRINT_ONLY))
def test_a_resume_that_drops_or_adds_it_is_refused(name, src, models, plain_out, tmp_path):
    setting = EXAMPLES[name]
    refused(src, plain_out, models, dict(setting), name)  # added to a job begun without it
    out = tmp_path / "out"
    config, loaded = job(src, out, models, max_rows=2, **setting)
    run_job(config, loaded=loaded)
    refused(src, out, models, {}, name)  # dropped from a job begun with it
    config, loaded = job(src, out, models, **setting)
    rest = run_job(config, loaded=loaded)  # the original settings resume
    assert rest.num_rows_skipped == 2


def test_dropping_choices_on_resume_exits_2_and_writes_nothing(tiny_model_dir, src, tmp_path):
    """The audit's reproduction through the CLI: --choices on 4 rows, then a rerun without it."""
    runner = CliRunner()
    out = tmp_path / "out"
    common = ["run", "--input", str(src), "--output", str(out), "--model", str(tiny_model_dir), "--device", "cpu",
              "--dtype", "float32", "--id-column", "id", "--max-new-tokens", "3", "--kv-cache-memory", "16MiB",
              "--quiet"]
    first = runner.invoke(app, [*common, "--choices", "yes,no", "--max-rows", "4"])
    assert first.exit_code == 0, first.output
    before = committed_rows(out)
    again = runner.invoke(app, common)
    assert again.exit_code == 2, again.output
    assert "constraint" in again.output
    assert committed_rows(out) == before
