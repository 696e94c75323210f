"""Starts `tessera serve` as a subprocess on a free loopback port for integration tests."""

from __future__ import annotations

import os
import socket
import time

from tessera.bench.report import LocalServer
from tests import warm_spawn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(LocalServer):
    """The benchmark's launcher; arguments are `tessera serve` flags and must include --model-path."""

    def __init__(self, *args: str, startup_timeout: float = 180.0):
        args_list = list(args)
        i = args_list.index("--model-path")
        model_path = args_list.pop(i + 1)
        args_list.pop(i)
        super().__init__(model_path, *args_list, startup_timeout_s=startup_timeout)

    def _start(self, argv: list[str]):
        fd = self.log.fileno()
        return warm_spawn.start("tessera", argv, lambda: super(ServerProcess, self)._start(argv), stdout=fd, stderr=fd)


def wait_until_idle(base_url: str, timeout: float = 30.0) -> dict:
    """The scheduler's stats once nothing runs, waits or holds KV (or the last ones seen at the timeout)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base_url}/get_server_info", timeout=30).json()["stats"]
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_used_tokens"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out
