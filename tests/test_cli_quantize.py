"""--quantize, --quantize-backend, --quantize-embedding and --kv-cache-dtype through `batchgen run`."""

from __future__ import annotations

import json
import shutil

import pytest
from test_cli import TEXTS, invoke, ok, read_output, runner, write_parquet  # noqa: F401  (runner: fixture)

pytest.importorskip("torchao")
pytest.importorskip("optimum.quanto")


def test_quantized_weights_and_int8_kv_run_and_enter_the_fingerprint(runner, tiny_model_dir, tmp_path):  # noqa: F811
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS)
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, "--quantize", "int8-weight", "--kv-cache-dtype", "int8"))
    assert read_output(out).num_rows == len(TEXTS)
    text = "".join(p.read_text() for p in out.rglob("*.json*") if p.is_file()).replace(" ", "")
    assert '"quantize":"int8-weight"' in text and '"kv_cache_dtype":"int8"' in text
    assert '"quantize_embedding":"auto"' in text
    # another scheme is another job: resuming with it is refused (exit 2), not mixed in
    again = invoke(runner, tiny_model_dir, src, out, "--quantize", "int4", "--kv-cache-dtype", "int8")
    assert again.exit_code == 2 and "quantize" in again.output + str(again.stderr if again.stderr_bytes else "")


@pytest.mark.parametrize(("args", "needle"), [(["--kv-cache-dtype", "fp8"], "fp8"),
                                              (["--quantize", "int8", "--quantize-backend", "quanto"], "torchao"),
                                              (["--quantize", "int3"], "quantize"),
                                              (["--quantize-embedding", "int4"], "quantize_embedding")])
def test_refusals_exit_2_naming_the_setting(runner, tiny_model_dir, tmp_path, args, needle):  # noqa: F811
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS)
    result = invoke(runner, tiny_model_dir, src, tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert needle in result.output + (result.stderr if result.stderr_bytes else "")


def test_prequantized_checkpoint_we_cannot_run_is_named(runner, tiny_model_dir, tmp_path):  # noqa: F811
    model_dir = tmp_path / "model"  # the message must name the method, not echo the path
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (model_dir / "config.json").write_text(json.dumps(config))
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS)
    result = invoke(runner, model_dir, src, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "gptq" in (result.output + (result.stderr if result.stderr_bytes else "")).lower()
