"""A Batch file's requests decide its job's task (batchgen.jobs.openai.batch_task): /v1/embeddings lines
run as --task embed; mixing kinds, or a --task that disagrees, is refused with exit 2 before any load."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config.job import JobConfig
from batchgen.errors import ConfigError, InputError
from batchgen.jobs.openai.batch_task import resolve_batch_task


def embed_line(custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "text-embedding-3-small", "input": text}}


def chat_line(custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}}


def write(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return str(path)


def job(*inputs, **settings) -> JobConfig:
    return JobConfig(inputs=list(inputs), input_format="openai-batch", output="out", **settings)


def test_embeddings_lines_make_an_embed_job_that_keeps_the_body(tmp_path):
    config = job(write(tmp_path / "e.jsonl", [embed_line("a", "x"), embed_line("b", "y")]))
    resolve_batch_task(config)
    config.validate(need_output=True)
    assert config.task == "embed" and config.keep_columns == ["method", "url", "model", "body"]
    chat = job(write(tmp_path / "c.jsonl", [chat_line("a", "x")]))
    resolve_batch_task(chat)
    chat.validate(need_output=True)
    assert chat.task == "generate" and chat.keep_columns == ["method", "url", "model"]


def test_a_generation_flag_with_embeddings_lines_is_refused(tmp_path):
    config = job(write(tmp_path / "e.jsonl", [embed_line("a", "x")]), max_new_tokens=5)
    with pytest.raises(ConfigError, match=r"e\.jsonl holds /v1/embeddings requests, which run as --task embed: "
                                          r"--max-new-tokens \(YAML max_new_tokens\) is a generation setting"):
        resolve_batch_task(config)


def test_a_task_that_disagrees_or_files_of_both_kinds_are_refused(tmp_path):
    embeds = write(tmp_path / "e.jsonl", [embed_line("a", "x")])
    chats = write(tmp_path / "c.jsonl", [chat_line("b", "y")])
    with pytest.raises(ConfigError, match="--task score: .*e.jsonl holds /v1/embeddings requests"):
        resolve_batch_task(job(embeds, task="score"))
    with pytest.raises(ConfigError, match="--task embed: .*c.jsonl holds /v1/chat/completions requests"):
        resolve_batch_task(job(chats, task="embed"))
    with pytest.raises(InputError, match="c.jsonl, row 0, column 'url': its first request is a "
                                         "/v1/chat/completions request, but .*e.jsonl holds /v1/embeddings"):
        resolve_batch_task(job(embeds, chats))


def test_run_refuses_a_mixed_file_with_exit_2_naming_the_line(tmp_path):
    path = write(tmp_path / "mixed.jsonl", [embed_line("a", "x"), embed_line("b", "y"), chat_line("c", "z")])
    result = CliRunner().invoke(app, ["run", "--input-format", "openai-batch", "-i", path,
                                      "-o", str(tmp_path / "out"), "--model", str(tmp_path / "no-model-needed")])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines[-1] == (f"error: {path}, row 2, column 'url': request 'c' is a /v1/chat/completions request, "
                         "but the file's first request (row 0) is a /v1/embeddings one: embeddings and completions "
                         "cannot share a job; put them in separate files and run each as its own job")
