"""Reading OpenAI Batch API request files (batchgen.io.inputs.openai_batch), built with the `openai` package's
own request types; the error-code convention of their error rows."""

from __future__ import annotations

import gzip
import json

import pydantic
import pytest
from openai.types.chat import ChatCompletionSystemMessageParam, ChatCompletionUserMessageParam
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsNonStreaming as TextParams
from openai.types.embedding_create_params import EmbeddingCreateParams

from batchgen.errors import InputError
from batchgen.io.inputs.cells import invalid_cells
from batchgen.io.inputs.discovery import resolve_inputs
from batchgen.io.inputs.openai_batch import OPENAI_BATCH_SCHEMA, api_error, split_api_error
from batchgen.io.inputs.readers import iter_batches, read_schema


def chat_request(custom_id: str, text: str, **body) -> dict:
    """A /v1/chat/completions request line whose body is checked against openai's own TypedDict."""
    params = ChatParams(model="gpt-4o-mini", messages=[
        ChatCompletionSystemMessageParam(role="system", content="Be brief."),
        ChatCompletionUserMessageParam(role="user", content=text)], **body)
    pydantic.TypeAdapter(ChatParams).validate_python(params)  # the package's types accept it
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": params}


def text_request(custom_id: str, prompt: str, **body) -> dict:
    params = TextParams(model="gpt-3.5-turbo-instruct", prompt=prompt, **body)
    pydantic.TypeAdapter(TextParams).validate_python(params)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": params}


def write_requests(path, lines) -> None:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")


def read_rows(path) -> list[dict]:
    [file] = resolve_inputs([str(path)], "openai-batch")
    assert file.format == "openai-batch"
    return [row for batch in iter_batches(file, None, 2) for row in batch.to_pylist()]


def test_requests_built_with_openai_types_are_read(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_requests(path, [
        chat_request("a", "hello", max_completion_tokens=5, temperature=0.7, seed=3, stop=["\n"]),
        text_request("b", "Once upon a time", max_tokens=4),
        chat_request("c", "more"),
    ])
    [file] = resolve_inputs([str(path)], "openai-batch")
    assert read_schema(file) == OPENAI_BATCH_SCHEMA
    rows = read_rows(path)
    assert [r["custom_id"] for r in rows] == ["a", "b", "c"]
    assert [r["url"] for r in rows] == ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"]
    assert rows[0]["model"] == "gpt-4o-mini" and rows[0]["method"] == "POST"
    body = json.loads(rows[0]["body"])
    assert body["messages"][1] == {"role": "user", "content": "hello"}
    assert body["max_completion_tokens"] == 5 and body["seed"] == 3 and body["stop"] == ["\n"]
    assert json.loads(rows[1]["body"])["prompt"] == "Once upon a time"


def test_gzip_and_only_the_columns_asked_for(tmp_path):
    path = tmp_path / "requests.jsonl.gz"
    write_requests(path, [text_request(f"r{i}", "x") for i in range(5)])
    [file] = resolve_inputs([str(path)], "openai-batch")
    batches = list(iter_batches(file, ["custom_id"], 2))
    assert [b.num_rows for b in batches] == [2, 2, 1]
    assert batches[0].schema.names == ["custom_id"]


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_requests(path, [text_request("a", "x"), '{"custom_id": "b", "method": ', text_request("c", "y")])
    with pytest.raises(InputError, match=r"requests\.jsonl, row 1: malformed JSON .* on line 2"):
        read_rows(path)


@pytest.mark.parametrize("line, why", [
    ({"method": "POST", "url": "/v1/completions", "body": {}}, "missing"),
    ({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}, "got 7"),
    ({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}, 'got ""'),
])
def test_custom_id_must_be_a_non_empty_string(tmp_path, line, why):
    path = tmp_path / "requests.jsonl"
    write_requests(path, [text_request("a", "x"), line])
    expected = rf"requests\.jsonl, row 1, column 'custom_id': .*non-empty string custom_id \(.*{why}\)"
    with pytest.raises(InputError, match=expected):
        read_rows(path)


def test_request_level_problems_are_rows_not_failures(tmp_path):
    """An unknown field in the line is an invalid cell (an error row); a body that is not an object
    or a missing body is kept for the request parser to answer."""
    path = tmp_path / "requests.jsonl"
    write_requests(path, [
        {**text_request("a", "x"), "priority": 1},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": "not an object"},
        {"custom_id": "c", "method": "GET", "url": "/v1/completions"},
    ])
    [file] = resolve_inputs([str(path)], "openai-batch")
    [batch] = list(iter_batches(file, None, 10))
    cells = invalid_cells(batch)
    assert list(cells) == [0]
    assert split_api_error(cells[0]) == ("invalid_request", "priority", cells[0].split(": ", 1)[1])
    rows = batch.to_pylist()
    assert json.loads(rows[1]["body"]) == "not an object" and rows[1]["model"] is None
    assert rows[2]["body"] is None and rows[2]["method"] == "GET"


def test_lone_surrogate_in_the_body_is_stored_escaped(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                    '"body": {"prompt": "bad \\ud800 text", "model": "m"}}\n', encoding="utf-8")
    [row] = read_rows(path)
    assert json.loads(row["body"])["prompt"] == "bad \ud800 text"  # round-trips; the parser refuses it


def test_openai_batch_reads_only_json_lines_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "requests.parquet"
    pq.write_table(pa.table({"custom_id": ["a"]}), path)
    with pytest.raises(InputError, match="openai-batch reads JSON Lines files"):
        resolve_inputs([str(path)], "openai-batch")


def test_forced_format_reads_any_suffix(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text('{"text": "hello"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="unsupported file type"):
        resolve_inputs([str(path)])
    [file] = resolve_inputs([str(path)], "jsonl")
    assert file.format == "jsonl" and read_schema(file).names == ["text"]


def test_api_error_round_trip():
    assert split_api_error(api_error("unsupported_url", "no")) == ("unsupported_url", None, "no")
    assert split_api_error(api_error("invalid_value", "a: b", "top_p")) == ("invalid_value", "top_p", "a: b")
    # messages of the prompt builder (no code) get the code that fits them
    assert split_api_error("prompt has 90 tokens; the model's context of 64 tokens minus max_new_tokens 8 "
                           "leaves room for 56")[0] == "context_length_exceeded"
    assert split_api_error("prompt column 'body' is empty") == ("invalid_prompt", None,
                                                               "prompt column 'body' is empty")


def embeddings_request(custom_id: str, text) -> dict:
    params = EmbeddingCreateParams(model="text-embedding-3-small", input=text)
    pydantic.TypeAdapter(EmbeddingCreateParams).validate_python(params)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": params}


def test_embeddings_requests_are_rows_but_never_beside_completions(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_requests(path, [embeddings_request("e1", "a"), {"custom_id": "odd", "method": "POST", "url": "/v1/x",
                                                          "body": {}}, embeddings_request("e2", ["b", "c"])])
    assert [(r["custom_id"], r["url"]) for r in read_rows(path)] == [
        ("e1", "/v1/embeddings"), ("odd", "/v1/x"), ("e2", "/v1/embeddings")]  # another url: its own error row
    write_requests(path, [embeddings_request("e1", "a"), embeddings_request("e2", "b"), text_request("t1", "x")])
    with pytest.raises(InputError, match=r"requests\.jsonl, row 2, column 'url': request 't1' is a /v1/completions "
                                         r"request, but the file's first request \(row 0\) is a /v1/embeddings one"):
        read_rows(path)
