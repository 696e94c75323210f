"""The adaptive CPU thread policy: the model gets the cores that nothing else used in the last window."""

from __future__ import annotations

import pytest

from tessera.config import ServerArgs
from tessera.platform.threads import AdaptiveThreads, machine_busy_seconds


class FakeMachine:
    """Clocks the policy reads, advanced by hand: `run(wall, ours, others)` adds wall seconds and the CPU
    seconds this process and everything else spent in them."""

    def __init__(self) -> None:
        self.busy = self.own = self.wall = 0.0
        self.calls: list[int] = []

    def run(self, wall: float, ours: float, others: float) -> None:
        self.wall += wall
        self.own += ours
        self.busy += ours + others

    def policy(self, cores: int, busy_clock=None) -> AdaptiveThreads:
        return AdaptiveThreads(cores, interval=0.25, slack=0.35,
                               busy_clock=busy_clock or (lambda: self.busy), own_clock=lambda: self.own,
                               wall_clock=lambda: self.wall, set_threads=self.calls.append)


def test_threads_follow_what_others_leave_free() -> None:
    m = FakeMachine()
    p = m.policy(cores=2)
    assert p.threads == 1 and m.calls == [1]  # cautious until a window has been seen
    m.run(0.5, ours=0.5, others=0.05)  # a frontend that only wakes to detokenize
    assert p.before_step() == 2
    m.run(0.5, ours=1.0, others=0.05)  # our own two threads do not count against us
    assert p.before_step() == 2
    m.run(0.5, ours=0.8, others=0.2)  # another program squeezed to 0.4 of a core: more than the slack
    assert p.before_step() == 1
    m.run(0.5, ours=0.5, others=0.5)  # a single-threaded program running beside us keeps us at one
    assert p.before_step() == 1
    m.run(0.5, ours=0.5, others=0.0)
    assert p.before_step() == 2
    assert m.calls == [1, 2, 1, 2]  # torch.set_num_threads only when the count changes


def test_many_cores_give_back_only_what_others_use() -> None:
    m = FakeMachine()
    p = m.policy(cores=8)
    assert p.threads == 7
    m.run(1.0, ours=7.0, others=2.5)
    assert p.before_step() == 5
    m.run(1.0, ours=5.0, others=12.0)  # others more than the machine has: never below one thread
    assert p.before_step() == 1


def test_windows_shorter_than_the_interval_keep_the_count() -> None:
    m = FakeMachine()
    p = m.policy(cores=2)
    m.run(0.1, ours=0.1, others=0.0)
    assert p.before_step() == 1  # 0.1 s of clock ticks says too little
    m.run(0.2, ours=0.2, others=0.0)
    assert p.before_step() == 2  # the window spans both


def test_without_proc_stat_the_cautious_count_stays() -> None:
    m = FakeMachine()
    p = m.policy(cores=4, busy_clock=lambda: None)
    m.run(1.0, ours=3.0, others=0.0)
    assert p.before_step() == 3


def test_proc_stat_is_read_on_linux() -> None:
    busy = machine_busy_seconds()
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0


def test_adaptive_only_without_a_fixed_count_and_with_one_rank() -> None:
    assert ServerArgs().adaptive_threads
    assert not ServerArgs(cpu_threads=2).adaptive_threads
    assert not ServerArgs(dp_size=2).adaptive_threads


def test_proc_stat_is_read_once_per_window_not_once_per_step() -> None:
    m = FakeMachine()
    reads: list[float] = []
    p = m.policy(cores=2, busy_clock=lambda: reads.append(m.wall) or m.busy)
    assert len(reads) == 1  # the first window's start
    for _ in range(20):  # decode steps of 10 ms: 0.2 s, inside the first 0.25 s window
        m.run(0.01, ours=0.01, others=0.0)
        p.before_step()
    assert len(reads) == 1
    for _ in range(10):  # to 0.3 s: the window closes once
        m.run(0.01, ours=0.01, others=0.0)
        p.before_step()
    assert len(reads) == 2 and p.threads == 2
