"""write_file_atomic when the filesystem fails it: a failed directory fsync after the rename keeps
the file (it replaced the old one already), and put-if-absent never degrades to a replace."""

from __future__ import annotations

import errno
import os

import pytest

from batchgen.errors import AlreadyExists, OutputError
from batchgen.io.store import local_files
from batchgen.io.store.local_files import write_file_atomic


def test_a_failed_directory_fsync_after_the_rename_keeps_the_new_file(tmp_path, monkeypatch):
    path = tmp_path / "_SUCCESS"
    path.write_bytes(b"old")

    def fail_dir_fsync(point: str) -> None:
        if point == "file_fsync_dir":
            raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(local_files, "_fault_hook", fail_dir_fsync)
    with pytest.raises(OutputError, match="could not sync its directory"):
        write_file_atomic(path, b"new")
    assert path.read_bytes() == b"new"  # before: removed, so neither the old file nor the new one
    assert [p.name for p in tmp_path.iterdir()] == ["_SUCCESS"]


def no_hard_links(monkeypatch):
    def link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(local_files.os, "link", link)


def test_without_hard_links_put_if_absent_never_replaces(tmp_path, monkeypatch):
    path = tmp_path / "00000001.json"
    path.write_bytes(b"theirs")
    no_hard_links(monkeypatch)
    with pytest.raises(AlreadyExists):
        write_file_atomic(path, b"ours", exclusive=True)  # before: silently replaced
    assert path.read_bytes() == b"theirs"
    write_file_atomic(tmp_path / "00000002.json", b"ours", exclusive=True)  # a free name: written
    assert (tmp_path / "00000002.json").read_bytes() == b"ours"
    assert sorted(os.listdir(tmp_path)) == ["00000001.json", "00000002.json"]


def test_without_hard_links_or_a_no_replace_rename_it_refuses(tmp_path, monkeypatch):
    no_hard_links(monkeypatch)
    monkeypatch.setattr(local_files, "_LIBC", None)
    with pytest.raises(OutputError, match="neither hard links"):
        write_file_atomic(tmp_path / "00000001.json", b"ours", exclusive=True)
    assert os.listdir(tmp_path) == []
