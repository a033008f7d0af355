"""The thread governor: compute threads follow the cores other processes leave."""

from __future__ import annotations

from batchgen.runtime.threads import ThreadGovernor


class FakeMachine:
    """A clock and /proc/stat-like counters: `run(seconds, ours, others)` advances them."""

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.threads: list[int] = []

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def governor(self, max_threads: int = 4) -> ThreadGovernor:
        return ThreadGovernor(max_threads, interval_s=5.0, read=lambda: (self.busy, self.own),
                              clock=lambda: self.now, set_threads=self.threads.append)


def test_threads_follow_the_cores_other_processes_leave():
    m = FakeMachine()
    g = m.governor(max_threads=4)
    m.run(6, ours=4, others=0.2)
    g.tick()
    assert g.num_threads == 4 and m.threads == []  # background noise keeps every thread
    m.run(6, ours=3, others=1.0)
    g.tick()
    assert g.num_threads == 3 and m.threads == [3]
    m.run(6, ours=1, others=3.6)
    g.tick()
    assert g.num_threads == 1  # never below one
    m.run(6, ours=4, others=0.0)
    g.tick()
    assert g.num_threads == 4 and m.threads == [3, 1, 4]


def test_rechecks_only_every_interval():
    m = FakeMachine()
    g = m.governor(max_threads=2)
    m.run(2, ours=1, others=2)
    g.tick()
    assert g.num_threads == 2  # 2 s of 5: not yet
    m.run(4, ours=1, others=2)
    g.tick()
    assert g.num_threads == 1


def test_gives_cores_up_at_once_and_takes_them_back_after_a_quiet_spell():
    m = FakeMachine()
    g = ThreadGovernor(2, interval_s=1.0, raise_after_s=5.0, read=lambda: (m.busy, m.own), clock=lambda: m.now,
                       set_threads=m.threads.append)
    m.run(1, ours=2, others=0.0)
    g.tick()
    assert g.num_threads == 2
    m.run(1, ours=1.3, others=0.7)  # a neighbour arrives: one second is enough to give a core up
    g.tick()
    assert g.num_threads == 1 and m.threads == [1]
    for _ in range(4):  # it leaves; the busy check is still within the last 5 s
        m.run(1, ours=1, others=0.0)
        g.tick()
        assert g.num_threads == 1
    m.run(1.5, ours=1, others=0.0)  # every check of the last 5 s left room
    g.tick()
    assert g.num_threads == 2 and m.threads == [1, 2]
    m.run(1, ours=1.5, others=0.6)  # a short burst still costs a core at once
    g.tick()
    assert g.num_threads == 1


def test_spinning_threads_count_niced_neighbours(monkeypatch):
    import torch

    from batchgen.runtime import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_base_threads", None)
    monkeypatch.setattr(threads, "_last_set", None)
    previous = torch.get_num_threads()
    calls = []
    monkeypatch.setattr(threads, "cpu_seconds", lambda count_niced=None: calls.append(count_niced) or (1.0, 1.0))
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        g = ThreadGovernor.for_device(torch.device("cpu"))
        calls.clear()
        g._read()
        assert calls == [True]  # spinning: a niced process's slices stall our barriers
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        g = ThreadGovernor.for_device(torch.device("cpu"))
        calls.clear()
        g._read()
        assert calls == [None]  # sleeping threads: niced processes only take what we leave
    finally:
        torch.set_num_threads(previous)


def test_a_later_engine_starts_from_the_full_count(monkeypatch):
    import torch

    from batchgen.runtime import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_base_threads", None)
    monkeypatch.setattr(threads, "_last_set", None)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        g = ThreadGovernor.for_device(torch.device("cpu"))
        assert g is not None and g.max_threads == 2
        threads._remember(1)
        torch.set_num_threads(1)  # as the first engine's governor left it
        assert ThreadGovernor.for_device(torch.device("cpu")).max_threads == 2
        torch.set_num_threads(1)
        threads._remember(2)  # the user set 1 themselves after the governor's 2: theirs wins
        assert ThreadGovernor.for_device(torch.device("cpu")) is None
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert ThreadGovernor.for_device(torch.device("cpu")) is None
    finally:
        torch.set_num_threads(previous)
