"""The GGUF cache (engine/model/gguf_cache.py): a .gguf converted once per content, published
atomically, a concurrent winner kept, a failed conversion leaving nothing behind."""

from __future__ import annotations

import pytest

from batchgen.engine.model import gguf_cache
from batchgen.errors import ModelLoadError


def _fake_convert(calls):
    def convert(gguf, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
    return convert


def test_gguf_cache_converts_once_and_publishes_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []
    monkeypatch.setattr(gguf_cache, "convert_gguf", _fake_convert(calls))
    first = gguf_cache.gguf_cache_dir(gguf, "m")
    assert gguf_cache.gguf_cache_dir(gguf, "m") == first and len(calls) == 1
    assert first.name == f"m-{gguf_cache.hash_files([gguf])[:12]}"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left behind
    gguf.write_bytes(b"GGUF other")  # new content, new cache entry
    assert gguf_cache.gguf_cache_dir(gguf, "m") != first and len(calls) == 2


def test_gguf_cache_race_uses_the_winner(monkeypatch, tmp_path):
    """Another process publishes while we convert: keep theirs, drop ours, no error."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    target = tmp_path / "cache" / "models" / f"m-{gguf_cache.hash_files([gguf])[:12]}"

    def convert(_gguf, out_dir):
        (out_dir / "config.json").write_text('{"ours": 1}')
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"theirs": 1}')

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    assert gguf_cache.gguf_cache_dir(gguf, "m") == target
    assert "theirs" in (target / "config.json").read_text()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")

    def convert(_gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise ValueError("unsupported architecture 'foo'\nmore detail")

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    with pytest.raises(ModelLoadError, match="cannot convert m.gguf: unsupported architecture 'foo'$"):
        gguf_cache.gguf_cache_dir(gguf, "m")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_conversion_says_it_runs_while_it_runs(monkeypatch, tmp_path, caplog):
    """A GGUF conversion takes about a minute for the embedded model: a line when it begins and
    lines while it lasts (transformers' own bar is off in a job), not 'takes a few seconds'."""
    import logging

    from batchgen.runtime import stage

    monkeypatch.setattr(stage, "HEARTBEAT_S", 0.02)
    caplog.set_level(logging.INFO, logger="batchgen")
    seen = []

    def slow_read(*args, **kwargs):  # the dequantizing read, long enough for two lines
        for _ in range(500):
            seen[:] = [r.getMessage() for r in caplog.records]
            if sum(" s so far" in m for m in seen) >= 2:
                break
            stage.threading.Event().wait(0.02)
        raise ModelLoadError("stop here")

    monkeypatch.setattr(gguf_cache.transformers.AutoModelForCausalLM, "from_pretrained", slow_read)
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    with pytest.raises(ModelLoadError, match="stop here"):
        gguf_cache.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert seen[0] == f"converting m.gguf to safetensors in {tmp_path} (once; later runs reuse it) ..."
    assert sum(m.startswith("converting m.gguf to safetensors") and m.endswith(" s so far") for m in seen) >= 2
