"""An embed job's committed rows -> Batch output lines in OpenAI's embedding response shape
(batchgen.jobs.openai.embedding_output through output.output_line), checked with the `openai` package's types."""

from __future__ import annotations

import base64
import json

import numpy as np
from openai.types import CreateEmbeddingResponse

from batchgen.jobs.openai.output import output_line

CONTEXT = {"model": "tiny-encoder", "digest": "0" * 16, "created": 1}


def rows(vectors, body, tokens=None, error=None) -> list[dict]:
    tokens = tokens or [3] * len(vectors)
    return [{"custom_id": "e1", "url": "/v1/embeddings", "sample_index": None if error else i,
             "embedding": None if error else v, "num_prompt_tokens": None if error else n, "error": error,
             "body": json.dumps(body)} for i, (v, n) in enumerate(zip(vectors, tokens, strict=True))]


def unit(*values) -> list[float]:
    v = np.asarray(values, dtype=np.float32)
    return (v / np.linalg.norm(v)).astype(np.float32).tolist()


def test_one_data_item_per_input_and_usage_summed():
    vectors = [unit(1, 2, 3, 4), unit(4, 3, 2, 1)]
    line = output_line(rows(vectors, {"input": ["a", "bb"]}, tokens=[3, 5]), CONTEXT)
    assert line["response"]["status_code"] == 200 and line["error"] is None
    response = CreateEmbeddingResponse.model_validate(line["response"]["body"])
    assert [d.index for d in response.data] == [0, 1] and response.model == "tiny-encoder"
    assert [d.embedding for d in response.data] == vectors  # the float32 values, exactly
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (8, 8)


def test_base64_decodes_to_the_float_vector():
    vectors = [unit(1, -2, 3, 0.5)]
    floats = output_line(rows(vectors, {"input": "a"}), CONTEXT)["response"]["body"]["data"][0]["embedding"]
    body = output_line(rows(vectors, {"input": "a", "encoding_format": "base64"}), CONTEXT)["response"]["body"]
    encoded = body["data"][0]["embedding"]
    assert isinstance(encoded, str)  # decoded as OpenAI's client decodes it before its types read the body:
    body["data"][0]["embedding"] = np.frombuffer(base64.b64decode(encoded), dtype="float32").tolist()
    assert CreateEmbeddingResponse.model_validate(body).data[0].embedding == floats


def test_dimensions_cut_and_renormalize_a_normalized_vector_only():
    normalized = unit(3, 4, 12, 0)
    body = output_line(rows([normalized], {"input": "a", "dimensions": 2}), CONTEXT)["response"]["body"]
    np.testing.assert_allclose(body["data"][0]["embedding"], [0.6, 0.8], rtol=1e-6)
    raw = [3.0, 4.0, 12.0, 0.0]  # a job run with --no-normalize: only cut
    body = output_line(rows([raw], {"input": "a", "dimensions": 2}), CONTEXT)["response"]["body"]
    assert body["data"][0]["embedding"] == [3.0, 4.0]


def test_too_many_dimensions_and_error_rows_are_400_lines():
    line = output_line(rows([unit(1, 2)], {"input": "a", "dimensions": 3}), CONTEXT)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"] == {
        "message": "dimensions 3 exceeds the job's embedding size of 2 (the model's, or --dimensions)",
        "type": "invalid_request_error",
        "param": "dimensions", "code": "invalid_value"}
    line = output_line(rows([None], {"input": ""}, error="invalid_value [input]: input is an empty string"), CONTEXT)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["code"] == "invalid_value"
    assert line["response"]["body"]["error"]["param"] == "input"
