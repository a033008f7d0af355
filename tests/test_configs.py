"""Every shipped config loads and validates; the example config matches the example data."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.config.job import JobConfig, build_config, load_config_file

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXAMPLES = ROOT / "examples"


def test_there_are_configs():
    assert {"default.yaml", "summarize.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path, tmp_path):
    config = build_config(path, inputs=[str(EXAMPLES / "docs.parquet")], output=str(tmp_path / "out"))
    assert config.inputs == [str(EXAMPLES / "docs.parquet")]


def test_default_yaml_lists_every_field_at_its_default():
    """default.yaml documents the defaults: it must not drift from JobConfig."""
    values = load_config_file(ROOT / "configs" / "default.yaml")
    defaults = dataclasses.asdict(JobConfig())
    assert set(values) == set(defaults), set(defaults) ^ set(values)
    assert values == defaults


def _columns_used(config: JobConfig) -> set[str]:
    used = {config.prompt_column, config.id_column, config.max_new_tokens_column}
    used |= set(re.findall(r"\{(\w+)\}", config.template or ""))
    used |= set(config.keep_columns or [])
    return used - {None}


@pytest.mark.parametrize("data", ["docs.parquet", "docs_small.jsonl"])
def test_summarize_config_fits_the_example_data(data, tmp_path):
    config = build_config(ROOT / "configs" / "summarize.yaml", inputs=[str(EXAMPLES / data)],
                          output=str(tmp_path))
    if data.endswith(".parquet"):
        rows = pq.read_table(EXAMPLES / data).to_pylist()
    else:
        rows = [json.loads(line) for line in (EXAMPLES / data).read_text(encoding="utf-8").splitlines()]
    assert rows and _columns_used(config) <= set(rows[0])
    ids = [r[config.id_column] for r in rows]
    assert len(set(ids)) == len(ids)
    assert all(r["num_chars"] == len(r["text"]) and r["max_new_tokens"] in (48, 96) for r in rows)


def test_example_data_shape():
    table = pq.read_table(EXAMPLES / "docs.parquet")
    assert table.num_rows == 79
    assert [str(t) for t in table.schema.types] == ["string", "string", "string", "int32", "int32"]
    lengths = table.column("num_chars").to_pylist()
    assert min(lengths) < 500 and max(lengths) > 20_000  # very different lengths, on purpose
    small = (EXAMPLES / "docs_small.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(small) == 8 and all(len(json.loads(line)["text"]) <= 1500 for line in small)


def test_make_docs_reproduces_the_committed_files(tmp_path):
    source = pq.read_schema(EXAMPLES / "docs.parquet").metadata[b"source"].decode()
    running = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    if not source.endswith(running):
        pytest.skip(f"examples were built with {source}; this is {running}, whose topics may differ")
    subprocess.run([sys.executable, str(EXAMPLES / "make_docs.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    assert pq.read_table(tmp_path / "docs.parquet").equals(pq.read_table(EXAMPLES / "docs.parquet"))
    assert (tmp_path / "docs_small.jsonl").read_bytes() == (EXAMPLES / "docs_small.jsonl").read_bytes()


def test_default_yaml_dtype_comment_says_what_auto_does():
    """auto on CPU is bf16 where the CPU has it natively (engine/loader.cpu_auto_dtype), not always fp32."""
    line = next(line for line in (ROOT / "configs" / "default.yaml").read_text().splitlines()
                if line.startswith("dtype:"))
    assert "fp32 on CPU)" not in line and "avx512_bf16" in line and "else fp32" in line
