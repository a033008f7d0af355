"""The output columns the README and docs/output-and-resume.md document are the ones a job writes."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from batchgen.io.store.schema import output_schema
from tests.test_readme import README, ROOT

OUTPUT_DOC = ROOT / "docs" / "output-and-resume.md"


def documented_columns(text: str) -> set[str]:
    """The column names in the first cell of the `| column | type | meaning |` table, less the id
    column's row and the passthrough columns' row (named by the input, not by batchgen)."""
    start = text.index("| column | type | meaning |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    kept = [cell for cell in rows if "id column" not in cell and "--id-column" not in cell
            and "passthrough" not in cell]
    return {name for cell in kept for name in re.findall(r"`([a-z_]+)`", cell)}


def written_columns() -> set[str]:
    """Every column batchgen itself may write: the output schema with each optional column on."""
    schema = output_schema(pa.field("id", pa.string()), [], with_prompt_hash=True, with_prompt_truncated=True,
                           with_logprobs=True, with_json_valid=True, with_sample_index=True, with_adapter=True)
    return set(schema.names) - {"id"}


@pytest.mark.parametrize(("page", "text"), [("README.md", README),
                                             ("docs/output-and-resume.md", OUTPUT_DOC.read_text(encoding="utf-8"))])
def test_documented_output_columns_are_the_written_ones(page, text):
    documented = documented_columns(text)
    written = written_columns()
    assert documented == written, (page, "undocumented:", sorted(written - documented),
                                   "documented but never written:", sorted(documented - written))


def test_each_task_columns_are_documented():
    """docs/output-and-resume.md's `--task` table names every column embed, score and classify write
    in place of generate's."""
    text = OUTPUT_DOC.read_text(encoding="utf-8")
    section = text[text.index("### Embeddings, scores and classes"):text.index("### Several samples per row")]
    generate = set(output_schema(pa.field("id", pa.string()), []).names)
    for task in ("embed", "score", "classify"):
        own = set(output_schema(pa.field("id", pa.string()), [], task=task, embedding_dim=4).names) - generate
        row = next(line for line in section.splitlines() if line.startswith(f"| `{task}` |"))
        assert own and own == set(re.findall(r"`([a-z_]+)` [a-z]", row)), (task, own, row)
