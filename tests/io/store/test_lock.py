"""batchgen.io.store.lock: one live job per output directory; a dead job's lock is taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from batchgen.errors import OutputLocked
from batchgen.io.store import lock as lock_module
from batchgen.io.store.claim import boot_id, pid_namespace
from batchgen.io.store.lock import LOCK_FILE, OutputLock, lock_holder


def here(pid: int, **more) -> str:
    """A lock file's record of `pid` on this host, kernel and pid namespace, as a job writes it."""
    return json.dumps({"pid": pid, "host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
                       **more})


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold_lock_in_subprocess(out_dir):
    """A second process that takes the lock and keeps it until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from batchgen.io.store.lock import OutputLock
        lock = OutputLock({str(out_dir)!r})
        lock.acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_acquire_release_and_the_holder_file(tmp_path):
    with OutputLock(tmp_path) as held:
        assert held.held
        info = json.loads((tmp_path / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert lock_holder(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()
    assert lock_holder(tmp_path) is None


def test_a_second_lock_in_the_same_process_is_refused(tmp_path):
    with OutputLock(tmp_path):
        with pytest.raises(OutputLocked, match=rf"in use by another batchgen job \(pid {os.getpid()} on "):
            OutputLock(tmp_path).acquire()
    with OutputLock(tmp_path):  # free again
        pass


def test_a_live_process_holding_the_lock_is_refused_and_its_death_frees_it(tmp_path, caplog):
    proc = hold_lock_in_subprocess(tmp_path)
    try:
        with pytest.raises(OutputLocked) as info:
            OutputLock(tmp_path).acquire()
        assert f"pid {proc.pid}" in str(info.value) and "wait for it to finish" in str(info.value)
        assert lock_holder(tmp_path)["pid"] == proc.pid
    finally:
        proc.kill()  # SIGKILL: no cleanup runs; the lock file stays behind
        proc.wait()
    assert (tmp_path / LOCK_FILE).exists()
    assert lock_holder(tmp_path) is None  # the pid is dead
    with caplog.at_level(logging.INFO, logger="batchgen.io.store.lock"):
        with OutputLock(tmp_path):
            pass
    assert f"left by pid {proc.pid}, which is no longer running" in caplog.text


def test_a_stale_lock_file_naming_a_dead_pid_is_taken_over(tmp_path):
    pid = dead_pid()
    (tmp_path / LOCK_FILE).write_text(here(pid, started=0))
    assert lock_holder(tmp_path) is None
    with OutputLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_released_lock_file_unlinked_under_a_waiting_opener_is_not_shared(tmp_path, monkeypatch):
    """The holder unlinks on release; a job that opened the old inode must not think it holds the lock."""
    first = OutputLock(tmp_path)
    first.acquire()
    real_open = os.open
    opened = []

    def open_then_release(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:
            opened.append(fd)
            first.release()  # the holder releases right after our open, before our flock
        return fd

    monkeypatch.setattr(lock_module.os, "open", open_then_release)
    second = OutputLock(tmp_path)
    second.acquire()  # retries on the fresh file
    monkeypatch.undo()
    with pytest.raises(OutputLocked):
        OutputLock(tmp_path).acquire()
    second.release()


def test_without_fcntl_the_lock_is_an_exclusive_file_with_a_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "fcntl", None)
    with OutputLock(tmp_path):
        with pytest.raises(OutputLocked, match=f"pid {os.getpid()}"):
            OutputLock(tmp_path).acquire()
    (tmp_path / LOCK_FILE).write_text(here(dead_pid()))
    with OutputLock(tmp_path):
        pass
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host"}))
    with pytest.raises(OutputLocked, match="another-host"):  # cannot tell: presumed live
        OutputLock(tmp_path).acquire()


def test_zombie_holder_counts_as_dead(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited but not reaped: a zombie
        try:
            with open(f"/proc/{proc.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
        except OSError:
            pytest.skip("no /proc")
        time.sleep(0.02)
    (tmp_path / LOCK_FILE).write_text(here(proc.pid))
    assert lock_holder(tmp_path) is None
    proc.wait()
