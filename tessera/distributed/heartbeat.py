"""Heartbeats of the tensor-parallel ranks on other nodes, so node 0 sees one die while idle.

Node 0 cannot watch another machine's processes, and a dead rank otherwise shows only when a collective next
fails (a request). Each rank on another node adds 1 to its counter in the group's rendezvous store (served by
rank 0, node 0's scheduler) every HEARTBEAT_S; node 0 reads the counters, and a rank whose counter has not moved
for TIMEOUT_S is gone: the replica stops, so /health fails and the server exits as when a local rank dies.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger("tessera.tp")
HEARTBEAT_S = 0.5
TIMEOUT_S = 5.0  # ten missed beats (a rank loading its weights still beats: the thread runs beside it)


def _store():
    return dist.distributed_c10d._get_default_store()


def _key(rank: int) -> str:
    return f"tessera/heartbeat/{rank}"


def start_beating(rank: int) -> None:
    """On a rank of another node: beat until the process ends (or node 0's store is gone)."""
    store = _store()

    def beat() -> None:
        try:
            while True:
                store.add(_key(rank), 1)
                time.sleep(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - node 0 went away: the rank's own broadcast loop ends it
            return

    threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()


def watch_ranks(ranks: range, stopping: Callable[[], bool]) -> None:
    """On node 0: a rank in `ranks` that stops beating ends this process (exit 1), unless `stopping()`."""
    if not ranks:
        return
    store = _store()

    def watch() -> None:
        seen = {r: (-1, time.monotonic()) for r in ranks}
        while not stopping():
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for r in ranks:
                count = store.add(_key(r), 0)
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > TIMEOUT_S and not stopping():
                    logger.error("tensor-parallel rank %d (another node) stopped answering for %.0f s; stopping "
                                 "this replica", r, TIMEOUT_S)
                    logging.shutdown()
                    os._exit(1)

    threading.Thread(target=watch, name="tp-heartbeat-watch", daemon=True).start()
