"""An OpenAI Batch file of /v1/embeddings requests through `batchgen run`: it runs as an embed job on a
tiny sentence-transformers encoder, and output.jsonl answers each line in OpenAI's embedding response
shape (validated with the `openai` package's types), equal to sentence-transformers' encode."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from batchgen.config.job import JobConfig
from batchgen.jobs.commands.run import run_job
from tests.jobs.encode_fixtures import reference_embeddings, save_tiny_encoder_dir

TEXTS = ["the cat sat on the mat", "a b", "batch jobs embed a corpus for search", "x"]


def line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "text-embedding-3-small", **body}}) + "\n"


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_encoder_dir(tmp_path_factory.mktemp("encoder"))


def responses(out) -> dict[str, dict]:
    got = {}
    for name in ("output.jsonl", "errors.jsonl"):
        for text in (out / name).read_text(encoding="utf-8").splitlines():
            record = json.loads(text)
            got[record["custom_id"]] = record["response"]
    return got


def test_embeddings_batch_file_round_trip(tmp_path, encoder_dir):
    path = tmp_path / "requests.jsonl"
    path.write_text(line("one", {"input": TEXTS[0]}) + line("many", {"input": TEXTS[1:], "user": "u"})
                    + line("b64", {"input": TEXTS[0], "encoding_format": "base64"})
                    + line("short", {"input": [TEXTS[2]], "dimensions": 8})
                    + line("empty", {"input": ""}), encoding="utf-8")
    config = JobConfig(inputs=[str(path)], input_format="openai-batch", model=encoder_dir,
                       output=str(tmp_path / "out"), output_format="openai-batch")
    summary = run_job(config)
    assert config.task == "embed" and (summary.num_rows, summary.num_rows_error) == (5, 1)
    got = responses(tmp_path / "out")
    reference = reference_embeddings(encoder_dir, TEXTS)

    def cosine(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    bodies = {cid: CreateEmbeddingResponse.model_validate(r["body"]) for cid, r in got.items()
              if r["status_code"] == 200 and cid != "b64"}
    assert cosine(bodies["one"].data[0].embedding, reference[0]) >= 0.9999
    many = bodies["many"]
    assert [d.index for d in many.data] == [0, 1, 2]
    assert all(cosine(d.embedding, reference[1 + d.index]) >= 0.9999 for d in many.data)
    assert many.usage.prompt_tokens == many.usage.total_tokens > bodies["one"].usage.prompt_tokens > 0
    short = np.asarray(bodies["short"].data[0].embedding)
    assert short.shape == (8,) and abs(np.linalg.norm(short) - 1) < 1e-5  # cut, then normalized again
    assert cosine(short, reference[2][:8]) >= 0.9999
    b64 = json.loads(json.dumps(got["b64"]["body"]))  # decoded as OpenAI's client does, then read by its types
    b64["data"][0]["embedding"] = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "float32").tolist()
    assert CreateEmbeddingResponse.model_validate(b64).data[0].embedding == bodies["one"].data[0].embedding
    assert got["empty"]["status_code"] == 400 and got["empty"]["body"]["error"]["code"] == "invalid_value"

    rerun = run_job(JobConfig(inputs=[str(path)], input_format="openai-batch", model=encoder_dir,
                              output=str(tmp_path / "out"), output_format="openai-batch"))
    # resumed: only the error row is tried again (--retry-errors), and every line reads the same
    assert (rerun.num_rows, rerun.num_rows_error) == (1, 1) and responses(tmp_path / "out") == got
