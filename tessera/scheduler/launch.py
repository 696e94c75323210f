"""`python -m tessera.scheduler.launch IN OUT READY [DP_RANK]` with the ServerArgs JSON on stdin: a scheduler
child process. The settings come over the pipe, never argv, so `ps` never shows the API key.

A separate interpreter (not multiprocessing's spawn) so user scripts need no __main__ guard.
The child exits when its parent dies, so no scheduler outlives the engine that started it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from tessera.config import ServerArgs
from tessera.scheduler.scheduler import run_scheduler_process


def exit_with_parent() -> None:
    """A daemon thread ends this process when its parent dies (no child outlives the process that started
    it: the scheduler its frontend, a TP rank its scheduler or its node's `tessera serve`)."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def main() -> None:
    to_sched, from_sched, ready = sys.argv[1:4]
    dp_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    args = ServerArgs(**json.loads(sys.stdin.read()))
    if args.disable_tqdm:  # the weight-loading progress bar (models/weights.py)
        os.environ["TQDM_DISABLE"] = "1"
    exit_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    run_scheduler_process(args, to_sched, from_sched, ready, dp_rank)


if __name__ == "__main__":
    main()
