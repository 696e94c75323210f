"""The scheduler processes a frontend starts (one per --dp-size replica).

Each is `python -m tessera.entrypoints.scheduler_process IN OUT READY RANK` (started by platform/launch.py). It
connects to the frontend's endpoints, which may be bound later: ZeroMQ queues what it sends until then, so the
frontend launches these first and loads its own tokenizer and processor while they import torch and load the
model.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable

from tessera.config import ServerArgs
from tessera.platform.launch import spawn, stop_processes

SCHEDULER_MODULE = "tessera.entrypoints.scheduler_process"


def launch_schedulers(args: ServerArgs, endpoint: Callable[[str], str]) -> list[subprocess.Popen]:
    """Starts replica r's scheduler for r in range(dp_size); endpoint(name) is the frontend's address of
    `in{r}`, `out` and `ready{r}`. A failure part-way returns nothing: the ones started are stopped."""
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(args.dp_size):
            # Replica r drives GPUs base + r * tp .. base + (r + 1) * tp - 1.
            replica_args = args.replace(base_gpu_id=args.base_gpu_id + rank * args.tp_size)
            procs.append(spawn(SCHEDULER_MODULE, [endpoint(f"in{rank}"), endpoint("out"), endpoint(f"ready{rank}"),
                                                  str(rank)], dataclasses.asdict(replica_args)))
    except BaseException:
        stop_processes(procs)
        raise
    return procs
