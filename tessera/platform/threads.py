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
import threading
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
    takes it away. `reserved` (asked at every step, not once per window) is how many cores this process's own
    background work holds right now (the worker's encode-ahead thread): they are not the model's either,
    though their CPU time is this process's. The clocks are parameters so tests can drive the policy
    without a loaded machine.
    """

    def __init__(self, cores: int, interval: float = 0.25, slack: float = 0.35,
                 busy_clock: Callable[[], float | None] = machine_busy_seconds,
                 own_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None,
                 reserved: Callable[[], int] | None = None):
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.cores, self.interval, self.slack = cores, interval, slack
        self._busy, self._own, self._wall, self._set = busy_clock, own_clock, wall_clock, set_threads
        self._reserved = reserved
        self._last = self._sample()
        # Start cautious (as if others were busy) until the first window says otherwise.
        self._free = max(1, cores - 1)  # cores others left in the last window
        self.threads = self._free
        self._set(self.threads)

    def _sample(self) -> tuple[float | None, float, float]:
        return self._busy(), self._own(), self._wall()

    def before_step(self) -> int:
        """Refreshes the thread count when a window has passed; returns the count in force."""
        # The wall clock first: reading /proc/stat every step was 3% of a batch-1 decode step (demo-vl).
        if self._wall() - self._last[2] >= self.interval:
            self._refresh()
        threads = self._free
        if self._reserved is not None:
            threads = max(1, min(threads, self.cores - self._reserved()))
        if threads != self.threads:
            self.threads = threads
            self._set(threads)
        return threads

    def _refresh(self) -> None:
        now = self._sample()
        wall = now[2] - self._last[2]
        if now[0] is None or self._last[0] is None:  # no /proc/stat: keep the cautious count
            self._last = now
            return
        others = max(0.0, (now[0] - self._last[0]) - (now[1] - self._last[1])) / wall
        self._last = now
        self._free = min(self.cores, max(1, self.cores - math.ceil(others - self.slack)))


_THREADS_LOCK = threading.Lock()


def one_torch_thread(inherited: int) -> None:
    """Makes the calling thread run torch on one intra-op thread: the frontend's preprocessing threads (image
    resize, normalize, patchify) and the model worker's encode-ahead thread (worker/encode_ahead.py).

    Why: with torch's default (all cores) every op over an image's 150k values wakes an OpenMP team on the other
    cores, which then spin-wait for the next op, on the cores the scheduler process's model steps need (they
    also read as busy to its thread policy, AdaptiveThreads above). demo-vl workload a on 2 cores, 3 runs each, three
    alternations: 3.37-3.57 s per run with this, 3.95-4.18 s without; the frontend's own CPU time was 0.68-0.69
    vs 0.67-0.74 s, so one thread costs it nothing at these sizes.

    torch.set_num_threads also sets the count that threads started afterwards begin with (threads already
    running keep theirs; MKL's count is per thread): a throwaway thread puts that back to `inherited`, so the
    application's own threads are not changed.
    """
    import torch

    with _THREADS_LOCK:
        torch.get_num_threads()  # runs torch's once-per-thread setup first, which would reset the count later
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(inherited,), name="tessera-threads")
        restore.start()
        restore.join()
