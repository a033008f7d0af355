"""OpenAI Batch API files end to end: requests in, output.jsonl / errors.jsonl out, on the tiny Llama.

The response bodies are validated with the `openai` package's own ChatCompletion and Completion
models. The package (3.57) ships no type for a Batch output line itself (only the Batch object),
so the line's envelope is the API reference's BatchRequestOutput written here as a strict
pydantic model. Every test also checks exactly-once: each custom_id on exactly one line.
"""

from __future__ import annotations

import json
import time

import pyarrow.dataset as ds
import pydantic
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import OutputError
from batchgen.io.store import local_files
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 6
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


class _Error(pydantic.BaseModel, extra="forbid"):
    code: str | None = None
    message: str | None = None


class _Response(pydantic.BaseModel, extra="forbid"):
    status_code: int
    request_id: str
    body: dict | None = None


class BatchRequestOutput(pydantic.BaseModel, extra="forbid"):
    """The API reference's Batch output line (id, custom_id, response | error)."""
    id: str
    custom_id: str
    response: _Response | None
    error: _Error | None


def chat(custom_id: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], **body}}


def completion(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": TEXT,
            "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **body}}


REQUESTS = [
    chat("c1", "Hello there", max_tokens=3),
    chat("c2", "Summarize: the cat sat on the mat.", max_completion_tokens=MAX_NEW),
    completion("t1", "Once upon a time", max_tokens=4),
    chat("c3", "Tell me more", temperature=1.0, seed=5),
    completion("t2", "1 2 3"),
    {"custom_id": "e-url", "method": "POST", "url": "/v1/moderations", "body": {"input": "x", "model": "m"}},
    chat("e-tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
    completion("e-long", "word " * 200),
]
ERROR_CODES = {"e-url": "unsupported_url", "e-tools": "unsupported_parameter", "e-long": "context_length_exceeded"}


def write_requests(path, requests) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    return str(path)


def job(tmp_path, requests, out="out", **overrides):
    src = write_requests(tmp_path / "requests.jsonl", requests)
    values = dict(input_format="openai-batch", output_format="openai-batch", max_new_tokens=MAX_NEW)
    return tiny_job_config(src, tmp_path / out, overrides.pop("model_dir"), **{**values, **overrides})


def parquet_rows(out) -> dict:
    """The committed Parquet rows by custom_id, exactly once; beside output.jsonl the directory is read
    as docs/openai-batch.md says (a JSON Lines file is no Parquet part)."""
    table = ds.dataset(str(out), format="parquet", exclude_invalid_files=True).to_table()
    ids = table.column("custom_id").to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice"
    return {row["custom_id"]: row for row in table.to_pylist()}


def read_lines(out, dir_name: str = ".") -> tuple[dict, dict]:
    """(output.jsonl, errors.jsonl) as {custom_id: line}; every line validated; no custom_id twice."""
    files = []
    for name in ("output.jsonl", "errors.jsonl"):
        lines = [json.loads(line) for line in (out / dir_name / name).read_text(encoding="utf-8").splitlines()]
        for line in lines:
            BatchRequestOutput.model_validate(line)
        ids = [line["custom_id"] for line in lines]
        assert len(ids) == len(set(ids)), f"a custom_id appears twice in {name}"
        files.append({line["custom_id"]: line for line in lines})
    assert not set(files[0]) & set(files[1]), "a custom_id is in both files"
    return files[0], files[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir, loaded, one_thread):
    tmp = tmp_path_factory.mktemp("openai-batch")
    config = job(tmp, REQUESTS, model_dir=tiny_model_dir)
    summary = run_job(config, loaded=loaded)
    return tmp / "out", summary


def test_every_line_validates_with_the_openai_types(finished):
    out, summary = finished
    ok, errors = read_lines(out)
    assert set(ok) | set(errors) == {r["custom_id"] for r in REQUESTS}
    parquet = parquet_rows(out)
    for custom_id, line in ok.items():
        request = next(r for r in REQUESTS if r["custom_id"] == custom_id)
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        parsed = (ChatCompletion if request["url"] == CHAT else Completion).model_validate(body)
        [choice] = parsed.choices
        row = parquet[custom_id]
        text = choice.message.content if request["url"] == CHAT else choice.text
        assert text == row["generated_text"]
        assert choice.finish_reason == row["finish_reason"] in ("stop", "length")
        assert parsed.usage.prompt_tokens == row["num_prompt_tokens"]
        assert parsed.usage.completion_tokens == row["num_generated_tokens"]
        assert parsed.usage.total_tokens == row["num_prompt_tokens"] + row["num_generated_tokens"]
        limit = request["body"].get("max_tokens") or request["body"].get("max_completion_tokens") or MAX_NEW
        assert row["num_generated_tokens"] <= limit
        if choice.finish_reason == "length":
            assert row["num_generated_tokens"] == limit  # truthful: "length" only at the row's own limit
        assert parsed.model != request["body"]["model"]  # the model that ran, not the one asked for
        assert row["model"] == request["body"]["model"]  # which the Parquet output records
        assert parsed.created > 0 and parsed.id
    for custom_id, line in errors.items():
        assert line["error"] is None and line["response"]["status_code"] == 400
        error = line["response"]["body"]["error"]
        assert error["code"] == ERROR_CODES[custom_id] and error["type"] == "invalid_request_error"
        assert error["message"] == parquet[custom_id]["error"].split(": ", 1)[1]
    assert json.loads((out / "_SUCCESS").read_text())["openai_batch"]["files"] == {
        "output.jsonl": {"rows": 5}, "errors.jsonl": {"rows": 3}}


def test_per_request_settings_reach_the_engine(tmp_path, tiny_model_dir, loaded, one_thread):
    """A request without sampling fields is the job's greedy row; max_tokens, seed, temperature and
    stop of each request change its row alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = "The quick brown fox"
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"text": [prompt]}), plain)
    run_job(tiny_job_config(plain, tmp_path / "plain", tiny_model_dir, max_new_tokens=MAX_NEW, chat=True),
            loaded=loaded)
    [greedy] = [r["generated_text"] for r in committed_rows(tmp_path / "plain", "row_id").values()]
    stop = next(ch for ch in greedy[2:] if ch != "\ufffd" and ch.strip())
    requests = [chat("greedy", prompt), chat("short", prompt, max_tokens=2),
                chat("s5", prompt, temperature=1.0, seed=5), chat("s5-again", prompt, temperature=1.0, seed=5),
                chat("s6", prompt, temperature=1.0, seed=6), chat("stop", prompt, stop=[stop])]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir), loaded=loaded)
    rows = parquet_rows(tmp_path / "out")
    assert rows["greedy"]["generated_text"] == greedy
    assert rows["short"]["num_generated_tokens"] <= 2 and greedy.startswith(rows["short"]["generated_text"])
    assert rows["s5"]["generated_text"] == rows["s5-again"]["generated_text"]  # the request's seed, as given
    assert rows["s5"]["generated_text"] != rows["s6"]["generated_text"]
    assert rows["s5"]["generated_text"] != greedy
    assert rows["stop"]["generated_text"] == greedy[:greedy.index(stop)]
    assert rows["stop"]["finish_reason"] == "stop"
    ok, errors = read_lines(tmp_path / "out")
    assert set(ok) == {r["custom_id"] for r in requests} and not errors


def test_resume_after_a_failure_writes_each_custom_id_once(tmp_path, tiny_model_dir, loaded, one_thread,
                                                           monkeypatch):
    """A run that fails part way commits what finished and writes no files; the rerun completes the
    job and the files hold every custom_id exactly once. A failure while the files are written
    leaves no _SUCCESS, and the next run writes them again."""
    from batchgen.jobs.executors.local import LocalJob

    requests = [chat(f"r{i}", f"prompt number {i}", max_tokens=3) for i in range(8)] + REQUESTS[5:]
    config = job(tmp_path, requests, model_dir=tiny_model_dir, commit_every_rows=2)
    finished_rows = LocalJob.finished

    def failing(self, planned, completion):
        if self.summary.num_rows >= 5:
            raise RuntimeError("injected failure")
        finished_rows(self, planned, completion)

    monkeypatch.setattr(LocalJob, "finished", failing)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(config, loaded=loaded)
    out = tmp_path / "out"
    assert 0 < len(parquet_rows(out)) < len(requests)
    assert not (out / "output.jsonl").exists() and not (out / "_SUCCESS").exists()
    monkeypatch.setattr(LocalJob, "finished", finished_rows)

    calls = []

    def fail_second_rename(stage):  # the second rename (errors.jsonl) fails
        if stage == "batch_file_rename":
            calls.append(stage)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_files, "_fault_hook", fail_second_rename)
    with pytest.raises(OutputError, match="Batch API output files"):
        run_job(config, loaded=loaded)
    assert not (out / "_SUCCESS").exists() and not (out / "errors.jsonl").exists()
    monkeypatch.setattr(local_files, "_fault_hook", None)

    summary = run_job(config.replace(retry_errors=False), loaded=loaded)
    assert summary.num_rows == 0  # every row was committed: only the files were left to write
    ok, errors = read_lines(out)
    assert set(ok) == {f"r{i}" for i in range(8)} and set(errors) == set(ERROR_CODES)
    assert (out / "_SUCCESS").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]

    before = (out / "output.jsonl").stat().st_mtime_ns
    run_job(config.replace(retry_errors=False), loaded=loaded)  # complete and current: not written again
    assert (out / "output.jsonl").stat().st_mtime_ns == before


def test_compact_writes_the_files_again_in_input_order(tmp_path, tiny_model_dir, loaded, one_thread):
    requests = [chat(f"r{i}", f"text {i}", max_tokens=1 + i % 3) for i in range(6)]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir, rows_per_part=2, output_format="both"),
            loaded=loaded)
    out = tmp_path / "out"
    assert not (out / "output.jsonl").exists()  # both: the directory stays one Parquet dataset
    assert set(committed_rows(out, "custom_id")) == {f"r{i}" for i in range(6)}
    before, _ = read_lines(out, "_openai_batch")
    time.sleep(1.1)  # compaction is a commit of its own, a second later: `created` must not follow it
    compact_output(out)
    lines = [json.loads(line) for line in (out / "_openai_batch" / "output.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
    assert {line["custom_id"]: line for line in lines} == before  # the same lines, byte for byte as JSON
    assert "openai_batch" in json.loads((out / "_SUCCESS").read_text())


def test_parquet_only_output_writes_no_batch_files(tmp_path, tiny_model_dir, loaded, one_thread):
    run_job(job(tmp_path, REQUESTS[:2], model_dir=tiny_model_dir, output_format="parquet"), loaded=loaded)
    assert not (tmp_path / "out" / "output.jsonl").exists()
    assert set(parquet_rows(tmp_path / "out")) == {"c1", "c2"}


def test_duplicate_custom_id_exits_2(tmp_path, tiny_model_dir):
    src = write_requests(tmp_path / "requests.jsonl", [chat("a", "x"), chat("b", "y"), chat("a", "z")])
    result = CliRunner().invoke(app, ["run", "--input", src, "--input-format", "openai-batch", "--output",
                                      str(tmp_path / "out"), "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--output-format", "openai-batch"])
    assert result.exit_code == 2, result.output
    assert "duplicate id 'a'" in result.output and "row 2" in result.output
    assert not (tmp_path / "out").exists()


def test_a_request_whose_settings_change_is_generated_again(tmp_path, tiny_model_dir, loaded, one_thread):
    """Under the same custom_id, a request is its prompt and its settings: a resume regenerates one
    whose max_tokens changed (replacing its row), and skips the unchanged one."""
    requests = [chat("a", "same text", max_tokens=2), chat("b", "other text", max_tokens=2)]
    config = job(tmp_path, requests, model_dir=tiny_model_dir)
    run_job(config, loaded=loaded)
    out = tmp_path / "out"
    first = parquet_rows(out)
    write_requests(tmp_path / "requests.jsonl", [chat("a", "same text", max_tokens=4), requests[1]])
    summary = run_job(config, loaded=loaded)
    assert (summary.num_rows, summary.num_rows_changed) == (1, 1)
    rows = parquet_rows(out)
    assert rows["b"] == first["b"]
    assert rows["a"]["generated_text"].startswith(first["a"]["generated_text"])
    grew = rows["a"]["num_generated_tokens"] > first["a"]["num_generated_tokens"]
    assert grew or first["a"]["finish_reason"] == "stop"
    ok, _ = read_lines(out)
    assert ok["a"]["response"]["body"]["choices"][0]["message"]["content"] == rows["a"]["generated_text"]


def test_logprobs_requests_get_the_apis_logprobs_shapes(tmp_path, tiny_model_dir, loaded, one_thread):
    """Chat (logprobs + top_logprobs) and completions (logprobs K): validated with the openai types,
    one entry per completion token, the alternatives as asked; other requests keep logprobs null."""
    requests = [chat("lp-chat", "Hello there", max_tokens=4, logprobs=True, top_logprobs=3),
                chat("lp-chat0", "Hi", max_tokens=3, logprobs=True, temperature=0.8, seed=1),
                completion("lp-text", "Once upon a time", max_tokens=5, logprobs=2),
                chat("plain", "Hello there", max_tokens=4)]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir, ignore_eos=True), loaded=loaded)
    ok, errors = read_lines(tmp_path / "out")
    assert not errors and set(ok) == {r["custom_id"] for r in requests}
    bodies = {cid: line["response"]["body"] for cid, line in ok.items()}
    chat_lp = ChatCompletion.model_validate(bodies["lp-chat"]).choices[0].logprobs
    assert len(chat_lp.content) == 4 and all(len(t.top_logprobs) == 3 for t in chat_lp.content)
    for t in chat_lp.content:
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == t.top_logprobs[0].logprob  # greedy: the chosen token is the likeliest
    text = "".join(t.token for t in chat_lp.content if not t.token.startswith("<|"))  # the text skips specials
    assert text == bodies["lp-chat"]["choices"][0]["message"]["content"]
    chat0 = ChatCompletion.model_validate(bodies["lp-chat0"]).choices[0].logprobs
    assert len(chat0.content) == 3 and all(t.top_logprobs == [] for t in chat0.content)
    text_lp = Completion.model_validate(bodies["lp-text"]).choices[0].logprobs
    assert len(text_lp.tokens) == len(text_lp.token_logprobs) == len(text_lp.top_logprobs) == 5
    assert all(len(alternatives) <= 2 for alternatives in text_lp.top_logprobs)
    assert text_lp.text_offset[0] == 0
    assert "".join(t for t in text_lp.tokens if not t.startswith("<|")) == bodies["lp-text"]["choices"][0]["text"]
    assert bodies["plain"]["choices"][0]["logprobs"] is None


def test_response_format_requests_round_trip(tmp_path, tiny_model_dir, loaded, one_thread):
    """json_object and json_schema requests: constrained rows whose content parses (and validates), in the
    API's ChatCompletion shape; a request with a bad schema is its own error line."""
    import jsonschema

    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "boolean"}},
              "required": ["mood", "n"], "additionalProperties": False}
    requests = [chat("js", "How are you?", max_tokens=40, response_format={
                    "type": "json_schema", "json_schema": {"name": "mood", "schema": schema, "strict": True}}),
                chat("js-sampled", "And you?", max_tokens=40, temperature=1.0, seed=3, response_format={
                    "type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}),
                completion("jo", "{", max_tokens=60, response_format={"type": "json_object"}),
                chat("text", "Hi", max_tokens=4, response_format={"type": "text"}),
                chat("bad", "Hi", response_format={"type": "json_schema",
                                                   "json_schema": {"name": "b", "schema": {"type": "nope"}}})]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir), loaded=loaded)
    ok, errors = read_lines(tmp_path / "out")
    assert set(errors) == {"bad"}
    error = errors["bad"]["response"]["body"]["error"]
    assert error["code"] == "invalid_value" and error["param"] == "response_format.json_schema.schema", error
    for cid in ("js", "js-sampled"):
        [choice] = ChatCompletion.model_validate(ok[cid]["response"]["body"]).choices
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    [choice] = Completion.model_validate(ok["jo"]["response"]["body"]).choices
    assert choice.finish_reason != "stop" or isinstance(json.loads(choice.text), dict), choice.text
    # the Parquet parts carry json_valid: the text parsed and validated for a JSON response_format's row,
    # null for a free one and for an error row
    valid = {cid: row["json_valid"] for cid, row in parquet_rows(tmp_path / "out").items()}
    assert valid["js"] is True and valid["js-sampled"] is True and valid["text"] is None and valid["bad"] is None
    assert valid["jo"] is (choice.finish_reason == "stop"), choice


def test_a_response_format_that_does_not_compile_is_its_requests_error(tmp_path, tiny_model_dir, loaded, one_thread,
                                                                        uncompilable):
    """A schema that passes the tokenizer-free check but does not compile for the model's tokenizer: that
    request's invalid_value error line, the other requests answered."""
    bad = {"type": "object", "properties": {"UNCOMPILABLE": {"type": "string"}}}
    requests = [chat("bad", "Hi", response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}}),
                chat("ok", "Hi", max_tokens=4)]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir), loaded=loaded)
    ok, errors = read_lines(tmp_path / "out")
    assert set(ok) == {"ok"} and set(errors) == {"bad"}
    error = errors["bad"]["response"]["body"]["error"]
    assert error["code"] == "invalid_value" and error["param"] == "response_format", error
    assert "does not compile" in error["message"], error
