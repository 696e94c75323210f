"""How many intra-op threads the scheduler process's model runs with on a CPU, decided step by step.

Why adaptive: on a machine with few cores, a fixed "all cores" policy is fastest while nothing else runs and
disastrous when something does (OpenMP threads wait at every barrier for a thread the OS has descheduled:
demo-vl's workload a measured 5x slower with 2 threads on 2 busy cores), while a fixed "all but one"
leaves half of a 2-core machine idle whenever the frontend is. So before each step the policy looks at how
much CPU everything *outside* this process used since it last looked (the machine's busy time from
/proc/stat minus this process's own CPU time) and gives the model the cores nobody else is using, at least
one. The frontend's bursts (image decoding, tokenization) and other programs both count as "others".

Reading /proc/stat and the process clock costs microseconds; the decision is refreshed at most every
`interval` seconds (clock ticks are 10 ms, so shorter windows would be noise) and changes only when the
count moves, so torch.set_num_threads is rarely called.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (None where /proc/stat is unreadable)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...; guest time is already inside user.
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


class AdaptiveThreads:
    """threads = cores - (cores' worth of CPU others used in the last window), rounded, within [1, cores].

    `slack` decides the rounding: others using up to `slack` of a core still leave that core to the model
    (a frontend that wakes briefly to detokenize should not halve the model's threads), more than that
    takes it away. The clocks are parameters so tests can drive the policy without a loaded machine.
    """

    def __init__(self, cores: int, interval: float = 0.25, slack: float = 0.35,
                 busy_clock: Callable[[], float | None] = machine_busy_seconds,
                 own_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None):
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.cores, self.interval, self.slack = cores, interval, slack
        self._busy, self._own, self._wall, self._set = busy_clock, own_clock, wall_clock, set_threads
        self._last = self._sample()
        # Start cautious (as if others were busy) until the first window says otherwise.
        self.threads = max(1, cores - 1)
        self._set(self.threads)

    def _sample(self) -> tuple[float | None, float, float]:
        return self._busy(), self._own(), self._wall()

    def before_step(self) -> int:
        """Refreshes the thread count when a window has passed; returns the count in force."""
        # The wall clock first: reading /proc/stat every step was 3% of a batch-1 decode step (demo-vl).
        if self._wall() - self._last[2] < self.interval:
            return self.threads
        now = self._sample()
        wall = now[2] - self._last[2]
        if now[0] is None or self._last[0] is None:  # no /proc/stat: keep the cautious count
            self._last = now
            return self.threads
        others = max(0.0, (now[0] - self._last[0]) - (now[1] - self._last[1])) / wall
        self._last = now
        threads = min(self.cores, max(1, self.cores - math.ceil(others - self.slack)))
        if threads != self.threads:
            self.threads = threads
            self._set(threads)
        return threads
