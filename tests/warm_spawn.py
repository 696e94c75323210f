"""The tests' Engines, servers and CLI runs start their processes from a warm interpreter instead of a cold one.

The suite starts ~120 Engines, each `python -m tessera.entrypoints.scheduler_process` in a fresh interpreter
that imports torch, torchvision (which pulls in torch._dynamo) and transformers before it loads a tiny model
(~3.4 s of CPU each), ~30 `tessera serve` and ~10 `tessera generate` processes that import as much before their
own children start: 500+ CPU seconds of a suite that is CPU-bound on 2 cores. Here those are forked from a
multiprocessing forkserver that imported those third-party packages once (never Tessera: its modules read
their TESSERA_* switches at import, so each child imports them itself, after taking the caller's environment).

A child differs from `platform/launch.py`'s in nothing the scheduler sees: the same module run as __main__ with
the same argv, its settings on stdin, the caller's environment, working directory and stdout/stderr, its exit
handlers run. Where the environment differs from the one the forkserver imported under in a variable those
packages read at import (TRITON_INTERPRET, a thread count, ...: IMPORT_TIME_ENV), the child is spawned cold as
before. demo-vl's Engine started in 3.3 s (3.4 s of the child's CPU) cold, 0.55 s (0.54 s) warm.
TESSERA_TEST_COLD_SPAWN=1 turns it off, for a run that starts every child as Tessera does; TESSERA_TEST_WARM_LOG=F
appends to F each cold start's reason (the variables that differed).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from multiprocessing import spawn as mp_spawn
from multiprocessing.reduction import DupFd
from typing import Any

# What a scheduler process imports before any Tessera code runs (measured with -X importtime).
PRELOAD = ["torch", "torchvision", "transformers", "transformers.image_processing_utils", "transformers.modeling_utils",
           "safetensors.torch", "zmq", "numpy", "PIL.Image"]
_state: dict[str, Any] = {}


# The variables the preloaded packages read when imported (or when their native libraries load: OpenMP's, MKL's),
# less those that libraries set in the tests' process and read only later, in the child (sglang's import sets the
# Triton and CUDA cache folders, inductor KMP_DUPLICATE_LIB_OK, the hub its download switch). CUDA is initialised
# in the child, so CUDA_* counts as read there.
IMPORT_TIME_ENV = ("TORCH", "PYTORCH_", "TRITON_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "HF_", "TRANSFORMERS_",
                   "TOKENIZERS_", "PYTHON", "LD_")
READ_LATER = ("TORCHINDUCTOR_", "TRITON_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "HF_XET_")


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(READ_LATER)}


class _InheritedFd:
    """A file descriptor of the caller that the child gets a duplicate of (pickled while the child starts)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _same, (DupFd(self.fd),)


def _same(x):
    return x


def _run_module(module: str, argv: list[str], settings: dict | None, env: dict[str, str], cwd: str,
                stdout, stderr) -> None:
    """In the forked child: `python -m module argv...` as launch.spawn starts it."""
    for target, inherited in ((1, stdout), (2, stderr)):
        fd = inherited.detach()
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdin = io.StringIO("" if settings is None else json.dumps(settings))
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, which would skip them
        sys.stdout.flush()
        sys.stderr.flush()


@contextlib.contextmanager
def _without_main():
    """multiprocessing would rerun the caller's __main__ (pytest itself) in the child: the child needs none."""
    original = mp_spawn.get_preparation_data

    def data(name):
        prepared = original(name)
        prepared.pop("init_main_from_path", None)
        prepared.pop("init_main_from_name", None)
        return prepared

    mp_spawn.get_preparation_data = data
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


class WarmChild:
    """The subset of subprocess.Popen that the launcher's callers use, over a forkserver child."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, args: list[str]):
        self._proc = proc
        self.pid = proc.pid
        self.args = args
        self.stdin = None

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()


def start(module: str, argv: Sequence[str], cold: Callable[[], Any], settings: dict[str, Any] | None = None,
          stdout: int = 1, stderr: int = 2):
    """`python -m module argv...` forked from the warm forkserver (settings, if any, on its stdin; its output to
    the caller's file descriptors stdout and stderr), or `cold()` where the environment does not allow it."""
    then, now = _state.get("env"), _comparable(dict(os.environ))
    if now != then:
        if then is not None and os.environ.get("TESSERA_TEST_WARM_LOG"):  # which variables made it cold
            with open(os.environ["TESSERA_TEST_WARM_LOG"], "a") as f:
                f.write(f"{module} {argv[:1]}: {sorted(k for k in {*now, *then} if now.get(k) != then.get(k))}\n")
        return cold()
    ctx = _state.get("ctx")
    if ctx is None:
        ctx = _state["ctx"] = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    sys.stdout.flush()
    sys.stderr.flush()
    stdio = (_InheritedFd(stdout), _InheritedFd(stderr))
    proc = ctx.Process(target=_run_module, daemon=False,
                       args=(module, list(argv), settings, dict(os.environ), os.getcwd(), *stdio))
    with _without_main():
        proc.start()
    return WarmChild(proc, [sys.executable, "-m", module, *argv])


def run(module: str, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run of `python -m module argv...` with its output captured as text, started warm."""
    cmd = [sys.executable, "-m", module, *argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = start(module, argv, lambda: subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL),
                     stdout=out.fileno(), stderr=err.fileno())
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read().decode(), err.read().decode())


def warm_spawn(module: str, argv: Sequence[str], settings: dict[str, Any]):
    """launch.spawn, from the warm forkserver where the environment allows."""
    from tessera.platform import launch

    return start(module, argv, lambda: launch.spawn(module, argv, settings), settings)


def install() -> None:
    """Routes the frontend's scheduler spawns through warm_spawn (the forkserver starts on first use); the
    tests' servers (tests/server/server_process.py) start through `start`."""
    from tessera.frontend import scheduler_procs

    _state["env"] = _comparable(dict(os.environ))
    scheduler_procs.spawn = warm_spawn
