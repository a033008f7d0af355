"""A user's mistakes answer before torch is imported; a finished job's rerun loads nothing.

Each case runs the real `batchgen` entry point in a fresh interpreter and reports whether torch
or transformers were imported by the time it exited: importing them takes seconds, so a mistake
that waits for them costs the user that much (7-10 s for `run -i nope.jsonl`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.jobs.commands.run import run_job

PROBE = """
import json, sys
from batchgen.cli import main
sys.argv = ["batchgen", *json.loads(sys.argv[1])]
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}),
      file=sys.__stdout__)
"""


def batchgen(*args: str) -> tuple[int, list[str], str]:
    """(exit code, heavy modules imported, stderr) of one CLI run in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([str(a) for a in args])],
                          capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report["code"], report["heavy"], proc.stderr


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b"], "body": ["first text", "second text"], "n": [1, 2]}), path)
    return path


def assert_answers_light(code: int, heavy: list[str], stderr: str, *needles: str) -> str:
    assert code == 2, stderr
    assert heavy == [], f"imported {heavy} before answering"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_missing_input_file(tmp_path):
    assert_answers_light(*batchgen("run", "-i", tmp_path / "nope.jsonl", "-o", tmp_path / "out"), "nope.jsonl")


def test_missing_prompt_column_suggests_the_likely_one(docs, tmp_path):
    line = assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out"), "prompt column 'text' not found")
    assert line.endswith("pass --prompt-column body"), line
    assert not (tmp_path / "out").exists()


def test_template_naming_a_missing_column(docs, tmp_path):
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--template", "Sum: {txt}"), "'txt'")


def test_unknown_config_key(docs, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("prompt_column: body\ntemprature: 5\n")
    assert_answers_light(*batchgen("run", "--config", config, "-i", docs, "-o", tmp_path / "out"),
                         "unknown setting 'temprature'; did you mean 'temperature'?")


def test_bad_sampling_value(docs, tmp_path):
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--prompt-column", "body",
                                   "--presence-penalty", "3"),
                         "--presence-penalty (YAML presence_penalty) must be in [-2, 2]")


def test_bad_logprobs_value(docs, tmp_path):
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--prompt-column", "body",
                                   "--logprobs", "21"),
                         "--logprobs (YAML logprobs) must be an integer in [0, 20]")


def test_output_directory_holding_something_else_is_refused(docs, tmp_path):
    out = tmp_path / "out"
    (out / "demo").mkdir(parents=True)  # e.g. `make demo` wrote out/demo/, and the README said --output out/
    line = assert_answers_light(*batchgen("run", "-i", docs, "-o", out, "--prompt-column", "body"),
                                "is not empty and is not a batchgen job's output directory")
    assert "demo/" in line
    assert sorted(p.name for p in out.iterdir()) == ["demo"]


def test_a_manifest_that_is_a_symbolic_link_is_refused(docs, tmp_path, tiny_model_dir):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "_manifest").symlink_to(elsewhere)  # before: followed, the job's entries written there
    assert_answers_light(*batchgen("run", "-i", docs, "-o", out, "--prompt-column", "body", "--model", tiny_model_dir,
                                   "--device", "cpu", "--max-new-tokens", "2"),
                         "has a symbolic link for its _manifest/ directory")
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["_manifest"]


def test_rerun_of_a_finished_job_loads_no_model(docs, tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    args = ["--prompt-column", "body", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "4", "--kv-cache-memory", "16MiB", "--quiet"]
    run_job(build_config(inputs=[str(docs)], output=str(out), prompt_column="body", model=str(tiny_model_dir),
                         device="cpu", dtype="float32", max_new_tokens=4, kv_cache_memory="16MiB", quiet=True))
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(["run", "-i", str(docs), "-o", str(out), *args])],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report == {"code": 0, "heavy": []}, proc.stderr
    assert "nothing to do: all 2 rows are committed (0 error rows); no model was loaded" in proc.stderr
    assert json.loads(lines[-2]) == {"output": str(out), "rows": 0, "errors": 0, "output_rows": 2, "output_errors": 0}
    # plan --output over the same job: the same answer, no model either
    plan_args = ["plan", "-i", str(docs), "-o", str(out), *args[:-1]]
    plan = subprocess.run([sys.executable, "-c", PROBE, json.dumps(plan_args)], capture_output=True, text=True,
                          timeout=120)
    assert json.loads(plan.stdout.strip().splitlines()[-1]) == {"code": 0, "heavy": []}, plan.stderr
    assert "nothing to do: all 2 rows are committed" in plan.stdout


@pytest.mark.parametrize(("flags", "needles"), [
    (["--no-chat", "--system", "Be brief."], ["--system needs the chat template", "--no-chat"]),
    (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype fp8 is not available", "--kv-cache-dtype int8"]),
    (["--kv-cache-dtype", "int8", "--attention-backend", "flash"], ["flash-attn reads no int8 KV pages"]),
    (["--quantize", "int4", "--quantize-backend", "onednn"], ["--quantize-backend onednn runs --quantize int8"]),
    (["--quantize", "int8", "--quantize-backend", "quanto"], ["runs on torchao only"]),
])
def test_impossible_combinations_answer_before_any_load(docs, tmp_path, flags, needles):
    """Choices no model or machine can make work are refused before torch is imported (not after
    loading the model for 12 s, as --no-chat --system would)."""
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--prompt-column", "body", *flags),
                         *needles)
    assert not (tmp_path / "out").exists()


def test_fp8_is_not_advertised():
    from typer.testing import CliRunner

    from batchgen.cli import app

    help_text = CliRunner().invoke(app, ["run", "--help"]).output
    kv_help = help_text[help_text.index("--kv-cache-dtype"):][:200]
    assert "int8" in kv_help and "fp8" not in kv_help


def test_a_batch_api_file_read_as_plain_jsonl_hints_the_input_format(tmp_path):
    path = tmp_path / "requests.jsonl"
    request = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    path.write_text(json.dumps(request) + "\n")
    line = assert_answers_light(*batchgen("run", "-i", path, "-o", tmp_path / "out"), "prompt column 'text' not found")
    assert line.endswith("these are OpenAI Batch API requests: pass --input-format openai-batch"), line


@pytest.mark.parametrize(("flags", "needle"), [
    (["--json-schema", '{"type": "foo"}'], "--json-schema (YAML json_schema): Invalid type: foo"),
    (["--json-schema", "no-such-schema.json"], "--json-schema (YAML json_schema): cannot read"),
    (["--regex", "[a-"], "--regex (YAML regex)"),
    (["--choices", "a,b", "--regex", "x"], "cannot go together"),
    (["--json-schema-column", "a", "--constraint-column", "b"], "cannot go together"),
    (["--constraint-column", "no_such_column"], "--constraint-column 'no_such_column' not found"),
], ids=["schema", "schema-file", "regex", "two", "two-columns", "missing-column"])
def test_bad_constraint_flags(docs, tmp_path, flags, needle):
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--prompt-column", "body", *flags),
                         needle)


def test_max_new_tokens_that_fill_the_context_answer_before_the_model(docs, tmp_path, tiny_model_dir):
    """The context is read from the model's config.json: every row would fail, so the job exits 2 at once."""
    assert_answers_light(*batchgen("run", "-i", docs, "-o", tmp_path / "out", "--prompt-column", "body",
                                   "--model", tiny_model_dir, "--max-new-tokens", "1000000"),
                         "--max-new-tokens (YAML max_new_tokens) 1000000 leaves no room for the prompt",
                         "(512 tokens)", "use at most 511")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet"])
def test_an_empty_input_exits_0_with_success_and_no_model(tmp_path, tiny_model_dir, name):
    src = tmp_path / name
    if name.endswith(".jsonl"):
        src.write_bytes(b"")
    else:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), src)
    out = tmp_path / "out"
    args = ["run", "-i", src, "-o", out, "--model", tiny_model_dir, "--device", "cpu", "--quiet"]
    code, heavy, stderr = batchgen(*args)
    assert (code, heavy) == (0, []), stderr
    assert "nothing to do: the input holds no rows; no model was loaded" in stderr and (out / "_SUCCESS").exists()
    assert_answers_light(*batchgen(*args[:4], tmp_path / "strict", *args[5:], "--no-allow-empty-input"),
                         "the input holds no rows (1 input file, every one empty)")
