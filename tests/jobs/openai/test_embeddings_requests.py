"""One /v1/embeddings request -> its inputs' token ids, or a coded error (batchgen.jobs.openai.embeddings);
request bodies checked against the `openai` package's own EmbeddingCreateParams."""

from __future__ import annotations

import json

import pydantic
import pytest
from openai.types.embedding_create_params import EmbeddingCreateParams

from batchgen.config.job import JobConfig
from batchgen.io.inputs.discovery import InputFile
from batchgen.io.inputs.openai_batch import split_api_error
from batchgen.jobs.openai.embeddings import MAX_INPUTS, parse_embeddings
from batchgen.jobs.openai.requests import prepare_request_row
from batchgen.jobs.prompting.prompts import PromptBuilder, Template
from batchgen.jobs.rows.rows import InputRow

URL = "/v1/embeddings"
FILE = InputFile("requests.jsonl", "openai-batch", None)


def row(body, url=URL, method="POST", checked=True) -> InputRow:
    if checked:  # a body the API's own types accept
        pydantic.TypeAdapter(EmbeddingCreateParams).validate_python({"model": "text-embedding-3-small", **body})
    values = {"custom_id": "e1", "method": method, "url": url, "model": None,
              "body": None if body is None else json.dumps(body)}
    return InputRow("e1", FILE, 0, values)


def error_of(request_row: InputRow, builder=None) -> tuple[str, str | None, str]:
    with pytest.raises(Exception) as info:
        if builder is None:
            parse_embeddings(request_row.values)
        else:
            prepare_request_row(request_row, builder, config())
    return split_api_error(str(info.value))


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer, Template(None, "body"), system=None, chat=None, max_context_tokens=16)


def config() -> JobConfig:
    return JobConfig(inputs=["x.jsonl"], input_format="openai-batch", task="embed").validate(need_output=False)


def test_the_four_input_shapes():
    assert parse_embeddings(row({"input": "a b"}).values).inputs == ["a b"]
    assert parse_embeddings(row({"input": ["a", "b"]}).values).inputs == ["a", "b"]
    assert parse_embeddings(row({"input": [5, 6, 7]}).values).inputs == [[5, 6, 7]]
    assert parse_embeddings(row({"input": [[5, 6], [7]]}).values).inputs == [[5, 6], [7]]
    request = parse_embeddings(row({"input": "x", "dimensions": 8, "encoding_format": "base64",
                                    "user": "u1"}).values)
    assert (request.dimensions, request.encoding_format) == (8, "base64")
    assert parse_embeddings(row({"input": "x"}).values).encoding_format == "float"


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"input": ""}, "invalid_value", "input"),
    ({"input": ["a", ""]}, "invalid_value", "input[1]"),
    ({"input": []}, "invalid_value", "input"),
    ({"input": ["a", [1, 2]]}, "invalid_value", "input[1]"),
    ({"input": [[1], []]}, "invalid_value", "input[1]"),
    ({"input": 5}, "invalid_request", "input"),
    ({"input": [True]}, "invalid_value", "input[0]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "invalid_value", "input"),
    ({"input": "a", "dimensions": 0}, "invalid_value", "dimensions"),
    ({"input": "a", "dimensions": 2.5}, "invalid_value", "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "invalid_value", "encoding_format"),
    ({"input": "a", "messages": []}, "unsupported_parameter", "messages"),
])
def test_what_the_api_refuses_is_a_coded_error(body, code, param):
    got_code, got_param, message = error_of(row(body, checked=False))
    assert (got_code, got_param) == (code, param), message


def test_a_generation_url_in_an_embed_job_is_unsupported():
    assert error_of(row({"messages": []}, url="/v1/chat/completions", checked=False))[:2] == ("unsupported_url", "url")
    assert error_of(row({"input": "a"}, method="GET"))[:2] == ("unsupported_method", "method")


def test_each_input_is_its_own_sample_tokenized_as_a_plain_row(builder, tokenizer):
    planned = prepare_request_row(row({"input": ["hello there", "bye"]}), builder, config())
    ids = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in ("hello there", "bye")]
    assert planned.encode_inputs == ids and planned.num_samples == 2
    assert planned.prompt_token_ids == ids[0] + ids[1]  # usage and the hash cover every input
    one = prepare_request_row(row({"input": "hello there"}), builder, config())
    assert (one.encode_inputs, one.num_samples, one.prompt_token_ids) == (None, 1, ids[0])
    tokens = prepare_request_row(row({"input": [[3, 4], [5]]}), builder, config())
    assert tokens.encode_inputs == [[3, 4], [5]]  # token ids as given: no special tokens added


def test_settings_and_input_boundaries_enter_the_prompt_hash(builder):
    def digest(body):
        return prepare_request_row(row(body), builder, config()).prompt_hash

    base = digest({"input": [[3, 4], [5]]})
    assert base != digest({"input": [[3], [4, 5]]})  # same tokens, other inputs
    assert base != digest({"input": [[3, 4], [5]], "dimensions": 4})
    assert base != digest({"input": [[3, 4], [5]], "encoding_format": "base64"})
    assert base == digest({"input": [[3, 4], [5]], "user": "someone"})


def test_too_long_or_out_of_vocabulary_is_an_error_row_never_cut(builder, tokenizer):
    code, param, message = error_of(row({"input": ["ok", "word " * 40]}), builder)
    assert (code, param) == ("context_length_exceeded", "input[1]") and "at most 16" in message
    code, param, _ = error_of(row({"input": [len(tokenizer) + 3]}), builder)
    assert (code, param) == ("invalid_value", "input")
