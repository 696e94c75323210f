"""Resident memory of a server's whole process tree, read from /proc (Linux), sampled while a benchmark runs.

A server is more than one process (Tessera: the HTTP frontend, its scheduler replicas, preprocessing
workers; llama-server: one), so its footprint is the sum over the tree rooted at the process that listens
on the server's port. The sum counts pages shared between processes (libtorch's code, mapped by each) once
per process, as `ps` and the issue's figures do; each process's own peak (`VmHWM`, its lifetime high-water
mark, start-up included) is reported beside the sampled peak of the sum. At the end of a run the tree's PSS is
read as well (`Pss` in smaps_rollup: a page shared by n processes counts 1/n in each), what the server costs
the machine when its processes map the same libraries; it is read once, not sampled, because walking a large
process's page tables takes milliseconds (17 ms for 1 GB here) on the cores the benchmark measures.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process ended between listing and reading: it holds nothing now
        return None


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process now (0 once it is gone)."""
    statm = _read(f"/proc/{pid}/statm")
    return int(statm.split()[1]) * _PAGE if statm else 0


def hwm_bytes(pid: int) -> int:
    """The process's peak resident bytes since it started (VmHWM), 0 once it is gone."""
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """Proportional resident bytes of one process now (shared pages split between their users), 0 once it is
    gone or where smaps_rollup is unreadable."""
    for line in (_read(f"/proc/{pid}/smaps_rollup") or "").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def process_name(pid: int) -> str:
    """The command line, shortened: `python -m tessera.entrypoints.scheduler_process` -> that module."""
    args = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    args = [a for a in args if a]
    if args and os.path.basename(args[0]).startswith("python") and "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return os.path.basename(args[0]) if args else f"pid {pid}"


def process_tree(root: int) -> list[int]:
    """root and every descendant still running, root first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if os.path.exists(f"/proc/{pid}"):
            tree.append(pid)
            todo.extend(children.get(pid, ()))
    return tree


def listening_pid(port: int) -> int | None:
    """The process that holds a listening TCP socket on `port` (IPv4 or IPv6), or None (not found, or the
    socket belongs to another user's process whose descriptors cannot be read)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (_read(table) or "").splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    return int(entry)
            except OSError:
                continue
    return None


def server_pid(base_url: str) -> int | None:
    """The pid serving base_url when it is on this machine, else None."""
    parts = urlsplit(base_url)
    if parts.hostname not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        return None
    return listening_pid(parts.port or (443 if parts.scheme == "https" else 80))


@dataclass
class RssSampler:
    """Samples the tree's RSS every `interval_s` in a thread, between start() and stop()."""

    root: int
    interval_s: float = 0.1
    peak_total: int = 0
    peak_by_pid: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    hwm_by_pid: dict[int, int] = field(default_factory=dict)
    end_rss: int = 0
    end_pss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> list[int]:
        """One reading of the tree; returns its pids (and keeps the sum in end_rss, the latest reading)."""
        total, tree = 0, process_tree(self.root)
        for pid in tree:
            rss = rss_bytes(pid)
            total += rss
            if pid not in self.names:
                self.names[pid] = process_name(pid)
            self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), rss)
            self.hwm_by_pid[pid] = max(self.hwm_by_pid.get(pid, 0), hwm_bytes(pid))
        self.peak_total = max(self.peak_total, total)
        self.end_rss = total
        return tree

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> RssSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.end_pss = sum(pss_bytes(pid) for pid in self.sample())
        return self.report()

    def report(self) -> dict:
        """MiB figures: the sampled peak of the sum, and per process its sampled peak and VmHWM."""
        mib = 2**20
        return {"pid": self.root, "peak_rss_mib": self.peak_total / mib,
                "end_rss_mib": self.end_rss / mib, "end_pss_mib": self.end_pss / mib,
                "processes": [{"pid": pid, "name": self.names[pid], "peak_rss_mib": peak / mib,
                               "hwm_mib": self.hwm_by_pid.get(pid, 0) / mib}
                              for pid, peak in self.peak_by_pid.items()]}


def format_memory(report: dict) -> str:
    """One line: the total, then each process."""
    parts = ", ".join(f"{p['name']} {p['peak_rss_mib']:.0f} (hwm {p['hwm_mib']:.0f})" for p in report["processes"])
    line = f"{'Peak server RSS (MiB):':<34}{report['peak_rss_mib']:.0f}  [{parts}]"
    if report.get("end_pss_mib"):
        line += (f"\n{'Server RSS / PSS at the end (MiB):':<34}{report['end_rss_mib']:.0f} / "
                 f"{report['end_pss_mib']:.0f}  (PSS counts shared pages once)")
    return line
