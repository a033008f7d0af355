"""The kernel cache directory: made private whatever the umask, refused where others could change
it, and a cached kernel loaded from the very file its checks read."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from batchgen.engine.kernels import kernel_cache, loader

SOURCE = loader.CSRC / "argmax.c"
EVIL_C = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen(getenv("BATCHGEN_TEST_MARK"), "w");
    if (f) fclose(f);
}
"""

pytestmark = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                                reason="builds kernels with a C compiler")


@pytest.fixture
def umask_002():
    previous = os.umask(0o002)
    yield
    os.umask(previous)


def test_directories_it_creates_are_private_under_umask_002(monkeypatch, tmp_path, umask_002):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    built = loader.build(SOURCE)
    for directory in (tmp_path / "cache", tmp_path / "cache" / "kernels"):
        assert not directory.stat().st_mode & 0o022, oct(directory.stat().st_mode)
    assert kernel_cache.problem(built) is None


@pytest.mark.parametrize("where, mode, refused", [
    ("kernels", 0o775, True),  # group-writable: a group member could rename a .so over the checked one
    ("kernels", 0o777, True),
    ("kernels", 0o1777, False),  # sticky and ours: others cannot rename or delete our files
    ("above", 0o777, True),  # a directory above: the whole cache could be swapped
    ("above", 0o1777, False),
])
def test_a_cache_directory_others_can_change_is_refused(monkeypatch, tmp_path, caplog, where, mode, refused):
    root = tmp_path / "shared" / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(root))
    loader.build(SOURCE)
    (root / "kernels" if where == "kernels" else tmp_path / "shared").chmod(mode)
    loader.load_library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            lib = loader.load_library(SOURCE)
    finally:
        loader.load_library.cache_clear()
    assert (lib is None) == refused
    if refused:
        assert "could be changed by others" in caplog.text and "not sticky" in caplog.text


def test_a_cache_directory_of_another_user_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    loader.build(SOURCE)
    monkeypatch.setattr(kernel_cache.os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert "not by this user" in kernel_cache.dir_problem(tmp_path / "kernels")
    with pytest.raises(RuntimeError, match="could be changed by others"):
        loader.build(SOURCE)


def test_a_file_renamed_over_the_checked_one_is_never_loaded(monkeypatch, tmp_path):
    """Between the checks and the load, a writer swaps the .so: the load must read the checked file."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    mark = tmp_path / "constructor-ran"
    monkeypatch.setenv("BATCHGEN_TEST_MARK", str(mark))
    (tmp_path / "evil.c").write_text(EVIL_C)
    evil = tmp_path / "evil.so"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", str(tmp_path / "evil.c"), "-o", str(evil)], check=True)
    real_open = kernel_cache.open_trusted

    def open_then_swap(target):
        fd = real_open(target)
        os.replace(evil, target)  # the attacker's rename, after every check passed
        return fd

    monkeypatch.setattr(kernel_cache, "open_trusted", open_then_swap)
    lib = loader.load(SOURCE)
    assert not mark.exists(), "the swapped-in file's constructor ran"
    assert isinstance(lib, ctypes.CDLL) and hasattr(lib, "argmax_rows")
