"""The response body of one `/v1/embeddings` request in the Batch output files, from its committed rows.

    {"object": "list", "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N},
     "data": [{"object": "embedding", "index": i, "embedding": [floats] or "<base64>"}, ...]}

One data item per input, index = the row's sample_index; usage counts every input's tokens. The
committed embedding is the job's whole vector (a fixed-size Parquet column), so the request's own
`dimensions` and `encoding_format` (read from its body, which embed jobs keep) apply here:

- `dimensions` N keeps the first N values; a vector the job normalized (unit length) is normalized
  again after the cut, as the API's shortened embeddings are; an unnormalized one is only cut
  (Matryoshka truncation, as sentence-transformers' truncate_dim). An N larger than the job's
  vector is the API's error (400 invalid_value) for that request.
- `base64` is the vector's little-endian float32 bytes, base64-encoded: what OpenAI's client
  decodes with `np.frombuffer(base64.b64decode(s), dtype="float32")`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from batchgen.io.store.schema import EMBEDDING

BODY_COLUMN = "body"  # the request's body, kept in embed jobs' output (batchgen.jobs.openai.batch_task)
_UNIT_TOLERANCE = 1e-3  # |norm - 1| under which a float32 vector counts as normalized


class RequestRefused(Exception):
    """A committed request answered with a 400 line: (code, param, message) of its error body."""

    def __init__(self, code: str, param: str | None, message: str):
        super().__init__(message)
        self.code, self.param, self.message = code, param, message


def embeddings_body(rows: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """A successful request's `list` of embeddings; RequestRefused if its `dimensions` cannot be met."""
    dimensions, encoding_format = request_options(rows[0].get(BODY_COLUMN))
    data = []
    for index, row in enumerate(rows):
        vector = np.asarray(row[EMBEDDING], dtype=np.float32)
        if dimensions is not None:
            vector = cut(vector, dimensions)
        data.append({"object": "embedding", "index": index, "embedding": encoded(vector, encoding_format)})
    prompt_tokens = sum(int(row["num_prompt_tokens"]) for row in rows)
    return {"object": "list", "data": data, "model": context["model"],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def request_options(body: str | None) -> tuple[int | None, str]:
    """(dimensions, encoding_format) of a request's body as the job's parser accepted it
    (batchgen.jobs.openai.embeddings); a directory written without the body column gets the defaults."""
    fields = json.loads(body) if body else {}
    dimensions = fields.get("dimensions")
    return (int(dimensions) if dimensions is not None else None), fields.get("encoding_format") or "float"


def cut(vector: np.ndarray, dimensions: int) -> np.ndarray:
    if dimensions > vector.shape[0]:
        raise RequestRefused("invalid_value", "dimensions", f"dimensions {dimensions} exceeds the job's embedding "
                             f"size of {vector.shape[0]} (the model's, or --dimensions)")
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    short = vector[:dimensions]
    if abs(norm - 1.0) < _UNIT_TOLERANCE:
        short_norm = float(np.linalg.norm(short.astype(np.float64)))
        if short_norm > 0:
            short = (short.astype(np.float64) / short_norm).astype(np.float32)
    return short


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    assert encoding_format == "float", encoding_format
    return vector.tolist()
