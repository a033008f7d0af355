"""A `batchgen run --quantize none` process never imports torchao (transformers would import it
for every job, and torchao's import logs torch deprecation warnings), while a quantizing job and a
torchao pre-quantized checkpoint still get it."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.engine.model.hf_imports import needs_torchao

pytest.importorskip("torchao")

PROBE = """
import json, sys
from batchgen.cli import main
sys.argv = ["batchgen", *json.loads(sys.argv[1])]
code = 0
try:
    main()
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torchao": "torchao" in sys.modules}), file=sys.__stdout__)
"""


def test_a_run_without_quantization_imports_no_torchao(tmp_path, tiny_model_dir):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), src)
    args = ["run", "-i", str(src), "-o", str(tmp_path / "out"), "--model", str(tiny_model_dir), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "2", "--kv-cache-memory", "16MiB", "--quiet",
            "--quantize", "none"]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "torchao": False}, proc.stderr
    assert "register_constant" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("settings", "needed"), [
    (dict(), False),
    (dict(quantize="int4"), True),
    (dict(quantize="auto"), True),
    (dict(quantize_embedding="int8"), True),
    (dict(model="some-org/some-model"), True),  # a hub checkpoint may be torchao pre-quantized
    (dict(model="/models/x.gguf"), False),
])
def test_needs_torchao(tmp_path, settings, needed):
    assert needs_torchao(build_config(None, inputs=["x"], output="o", **settings)) is needed


def test_a_torchao_prequantized_local_checkpoint_needs_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "torchao"}}))
    assert needs_torchao(build_config(None, inputs=["x"], output="o", model=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not needs_torchao(build_config(None, inputs=["x"], output="o", model=str(tmp_path)))
