"""The scheduler processes a frontend starts (one per --dp-size replica) and stops.

Each is `python -m tessera.scheduler.launch IN OUT READY RANK` with its ServerArgs JSON on stdin (never argv:
`ps` would show the API key). It connects to the frontend's endpoints, which may be bound later: ZeroMQ
queues what it sends until then, so the frontend launches these first and loads its own tokenizer and
processor while they import torch and load the model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable

from tessera.config import ServerArgs

STOP_TIMEOUT_S = 10  # a scheduler that has not exited this long after SIGTERM is killed


def launch_schedulers(args: ServerArgs, endpoint: Callable[[str], str]) -> list[subprocess.Popen]:
    """Starts replica r's scheduler for r in range(dp_size); endpoint(name) is the frontend's address of
    `in{r}`, `out` and `ready{r}`. A failure part-way returns nothing: the ones started are stopped."""
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(args.dp_size):
            # Replica r drives GPUs base + r * tp .. base + (r + 1) * tp - 1.
            replica_args = args.replace(base_gpu_id=args.base_gpu_id + rank * args.tp_size)
            proc = subprocess.Popen(
                [sys.executable, "-m", "tessera.scheduler.launch", endpoint(f"in{rank}"), endpoint("out"),
                 endpoint(f"ready{rank}"), str(rank)],
                stdin=subprocess.PIPE,
            )
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(dataclasses.asdict(replica_args)).encode())
            proc.stdin.close()
    except BaseException:
        stop_processes(procs)
        raise
    return procs


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every one still running, then waits for each (killing it after STOP_TIMEOUT_S)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
