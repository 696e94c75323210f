"""Starting and stopping the engine's child processes: scheduler replicas, tensor-parallel ranks and the
preprocessing workers, all one way.

- A child is a fresh interpreter (`python -m MODULE ARGV...`), never a fork: the parent already runs threads
  (ZeroMQ, thread pools, maybe CUDA), whose locks a fork would copy; and user scripts need no __main__
  guard, as multiprocessing's spawn would require of them.
- Settings travel as JSON on the child's stdin, never in argv, so `ps` never shows the API key.
- A child exits when its parent dies (`exit_with_parent`), so none outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

STOP_TIMEOUT_S = 10  # a child that has not exited this long after SIGTERM is killed


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """Environment variables set for children started inside the block (they read their switches, e.g.
    TESSERA_BF16_COMPUTE, at import), then restored: for benchmarks that compare settings in one run."""
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(module: str, argv: Sequence[str], settings: dict[str, Any]) -> subprocess.Popen:
    """`python -m module argv...` with `settings` as JSON on its stdin (read it with `read_settings`)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(settings).encode())
    proc.stdin.close()
    return proc


def read_settings() -> dict[str, Any]:
    """In the child: the settings its parent wrote (see `spawn`)."""
    return json.loads(sys.stdin.read())


def child_setup(ignore_sigint: bool = True) -> None:
    """In the child, first thing: exit with the parent, exit at once on SIGTERM, and leave Ctrl-C (which
    the terminal sends to the whole group) to the parent, which decides when its children stop."""
    exit_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_with_parent() -> None:
    """A daemon thread ends this process when its parent dies."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to every one still running, then waits for each (killing it after timeout_s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def process_pool(initializer: Callable[..., None], initargs: tuple = ()) -> ProcessPoolExecutor:
    """A one-process pool whose worker is a fresh interpreter (spawn, for the reason above)."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                               initargs=initargs)
