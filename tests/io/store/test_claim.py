"""batchgen.io.store.claim: a holder is dead only when host, boot, pid namespace and process all say so.

Containers run with `--network host` share the host name but not the pid namespace: a pid that
does not exist here may be a live job next door, and its lease or lock must not be taken."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from batchgen.errors import OutputLocked
from batchgen.io.store.claim import boot_id, holder_is_dead, holder_record, pid_namespace, process_start
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_FILE, Lease, lease_holder
from batchgen.io.store.lock import LOCK_FILE, OutputLock, lock_holder

pytestmark = pytest.mark.skipif(boot_id() is None or pid_namespace() is None, reason="needs Linux /proc")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(pid: int, **changes) -> dict:
    return {"pid": pid, "host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
            "pid_start": process_start(pid), **changes}


def test_the_record_carries_the_identity_that_survives_a_shared_host_name():
    me = holder_record(0.0)
    assert me["boot_id"] == boot_id() and me["pid_ns"] == pid_namespace()
    assert me["pid_start"] == process_start(os.getpid()) and not holder_is_dead(me)


def test_a_pid_missing_here_in_another_pid_namespace_is_presumed_live():
    pid = dead_pid()
    assert holder_is_dead(record(pid))  # this namespace: gone
    assert not holder_is_dead(record(pid, pid_ns="pid:[1]"))  # before: dead by host + pid alone
    assert not holder_is_dead(record(pid, boot_id="another-boot"))
    assert not holder_is_dead({"pid": pid, "host": socket.gethostname()})  # an old record: cannot tell


def test_a_reused_pid_is_dead():
    assert holder_is_dead(record(os.getpid(), pid_start=process_start(os.getpid()) - 1))


def test_an_unexpired_lease_is_never_taken_over(s3_out, quick_lease_settle):
    store = open_store(s3_out)
    neighbour = {"holder": "next-door", **record(dead_pid(), pid_ns="pid:[1]"), "started": 0, "renewed": 0,
                 "expires": time.time() + 60, "ttl_s": 60}
    store.write_bytes(LEASE_FILE, json.dumps(neighbour).encode())
    assert lease_holder(store) is not None  # status and finalize: still running
    with pytest.raises(OutputLocked, match="expires in"):  # before: taken over at once
        Lease(store).acquire()
    neighbour.update(pid_ns=pid_namespace())  # even a holder known dead here: wait for the expiry
    store.write_bytes(LEASE_FILE, json.dumps(neighbour).encode())
    assert lease_holder(store) is None
    with pytest.raises(OutputLocked):
        Lease(store).acquire()


def test_lock_holder_reads_the_kernel_lock_table(tmp_path):
    with OutputLock(tmp_path):  # held by this process; the file says someone in another namespace
        (tmp_path / LOCK_FILE).write_text(json.dumps(record(dead_pid(), pid_ns="pid:[1]")))
        assert lock_holder(tmp_path) is not None
    (tmp_path / LOCK_FILE).write_text(json.dumps(record(dead_pid(), pid_ns="pid:[1]")))
    assert lock_holder(tmp_path) is not None  # another namespace's file, no flock seen: presumed live
    (tmp_path / LOCK_FILE).write_text(json.dumps(record(os.getpid())))
    assert lock_holder(tmp_path) is None  # this kernel: no flock on it means not held
