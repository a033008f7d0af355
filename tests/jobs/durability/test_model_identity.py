"""A finished job's rerun with another model is no "nothing to do": the model's files are compared
before it loads (engine/model/model_files.py), and where they differ the model loads and the
fingerprint's content hash and resolved dtype decide."""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.model import loader
from batchgen.engine.model.model_files import DEFAULT_MODEL, default_gguf_path, model_files_identity
from batchgen.errors import FingerprintMismatch
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.tiny import make_tiny_model

TEXTS = ["first row", "second row", "third row is longer"]
LOAD_MODEL = loader.load_model


class WeightsRead(Exception):
    pass


def count_loads(monkeypatch, *, refuse: bool):
    """Every model load from here on is counted (and, with `refuse`, fails the run)."""
    calls = []

    def load(*args, **kwargs):
        calls.append(args)
        if refuse:
            raise WeightsRead("the model was loaded")
        return LOAD_MODEL(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", load)
    return calls


@pytest.fixture()
def finished(tiny_model_dir, loaded, tmp_path):
    """A finished derived-id job over a copy of the tiny model that the test may change."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": TEXTS}), src)
    out = tmp_path / "out"
    first = run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3), loaded=loaded)
    assert first.complete and first.num_rows == len(TEXTS)
    return src, out, model_dir


def test_a_retrained_checkpoint_at_the_same_path_is_refused(finished, monkeypatch):
    src, out, model_dir = finished
    before = committed_rows(out, "row_id")
    loads = count_loads(monkeypatch, refuse=True)
    again = run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3))
    assert again.nothing_to_do and loads == []  # unchanged: decided without the model
    make_tiny_model("llama", seed=1).save_pretrained(model_dir)  # other weights, same names and shapes
    loads = count_loads(monkeypatch, refuse=False)
    with pytest.raises(FingerprintMismatch, match="model_revision") as info:
        run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3))
    assert info.value.exit_code == 2 and len(loads) == 1
    assert committed_rows(out, "row_id") == before


def test_another_dtype_is_refused(finished, monkeypatch):
    src, out, model_dir = finished
    count_loads(monkeypatch, refuse=False)
    with pytest.raises(FingerprintMismatch, match="dtype 'float32' -> 'bfloat16'") as info:
        run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3, dtype="bfloat16"))
    assert info.value.exit_code == 2


def test_the_same_weights_copied_anew_resume_after_one_load(finished, monkeypatch):
    """New modification times cannot be told from new weights without reading them: the model loads
    once, its content hash matches, the rerun has nothing to generate, and the next one needs no load."""
    src, out, model_dir = finished
    before = committed_rows(out, "row_id")
    for path in model_dir.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    loads = count_loads(monkeypatch, refuse=False)
    again = run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3))
    assert again.complete and again.num_rows == 0 and len(loads) == 1
    assert committed_rows(out, "row_id") == before
    loads = count_loads(monkeypatch, refuse=True)
    assert run_job(tiny_job_config(src, out, model_dir, max_new_tokens=3)).nothing_to_do and loads == []


def test_the_identity_sees_a_same_size_edit_and_the_dtype(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    first = model_files_identity(str(model_dir), "float32")
    assert first["path"] == str(model_dir.resolve()) and "config.json" in first["files"]
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor, same size, same modification time
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_files_identity(str(model_dir), "float32")["files"] != first["files"]
    assert model_files_identity(str(model_dir), "bfloat16")["dtype"] == "bfloat16"
    assert model_files_identity(str(tmp_path / "absent"), "auto")["files"] is None
    assert model_files_identity("batchgen-tests/not-in-the-cache", "auto")["files"] is None


def test_the_embedded_model_is_identified_by_its_gguf():
    try:
        gguf = default_gguf_path()
    except Exception:
        pytest.skip("the embedded default model is not installed")
    identity = model_files_identity(None, "auto")
    assert identity == model_files_identity(DEFAULT_MODEL, "auto")
    assert identity["path"] == str(gguf.resolve()) and list(identity["files"]) == [gguf.name]
