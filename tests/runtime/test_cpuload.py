"""/proc/stat readings of the other processes' CPU and the cgroup's CPU limit."""

from __future__ import annotations

from batchgen.runtime import cpuload


def test_other_cores_subtracts_our_own_time():
    samples = iter([(100.0, 10.0), (100.9, 10.3)])  # machine +0.9 s, of which ours +0.3 s
    slept = []
    cores = cpuload.other_cores(0.5, read=lambda: next(samples), sleep=slept.append)
    assert slept == [0.5] and abs(cores - 1.2) < 1e-9


def test_other_cores_off_linux_is_none():
    assert cpuload.other_cores(0.1, read=lambda: None, sleep=lambda s: None) is None


def test_reads_this_machine():
    sample = cpuload.cpu_seconds()
    if sample is not None:  # Linux
        busy, own = sample
        assert busy > 0 and own > 0


def test_cgroup_v2_and_v1_limits(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpuload.cgroup_cpu_limit(str(v2)) is None  # unlimited
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpuload.cgroup_cpu_limit(str(v2)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpuload.cgroup_cpu_limit(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cpuload.cgroup_cpu_limit(str(v1)) == 2.0
    assert cpuload.cgroup_cpu_limit(str(tmp_path / "none")) is None


def test_niced_time_counts_when_asked():
    with_niced, without = cpuload.cpu_seconds(count_niced=True), cpuload.cpu_seconds(count_niced=False)
    if with_niced is not None:  # Linux: the nice field only adds
        assert with_niced[0] >= without[0] - 0.02
