"""One cache root for converted models, kernels and inductor code, chosen by environment."""

from batchgen.runtime import cache_dir


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir.cache_root() == tmp_path / "a"
    monkeypatch.delenv("BATCHGEN_CACHE_DIR")
    assert cache_dir.cache_root() == tmp_path / "xdg" / "batchgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir.cache_root() == tmp_path / "home" / ".cache" / "batchgen"
