"""@function programs: run one against a backend, or a batch of them concurrently.

    @tessera.function
    def describe(s, path):
        s += tessera.user(tessera.image(path) + "Describe the image.")
        s += tessera.assistant(tessera.gen("caption", max_tokens=32, temperature=0))

    state = describe.run(path="scene.png", backend=engine)   # or backend="http://127.0.0.1:30000"
    state["caption"]
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tessera.lang.backend import Backend, as_backend
from tessera.lang.state import ForkGroup, ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend (an Engine, a server URL or a RuntimeEndpoint) for runs that do not name one."""
    global _default_backend
    _default_backend = as_backend(backend)


def _resolve(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise ValueError("backend: pass backend= (an Engine or a server URL) or call set_default_backend first")
    return _default_backend


class Program:
    """A function `f(s, *args, **kwargs)` that appends expressions to its state `s`."""

    def __init__(self, func: Callable[..., Any]):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"{func.__name__}: a program takes the state as its first argument")
        self.func = func
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def _start(self, backend: Backend, args: tuple, kwargs: dict) -> ProgramState:
        state = ProgramState(backend)
        self.func(state, *args, **kwargs)
        return state

    def run(self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Runs the program to its end and returns its state (results by name: state["name"]). With
        stream=True it returns at once; read the text as it comes with state.text_iter()."""
        if not stream:
            return self._start(_resolve(backend), args, kwargs).sync()
        state = ProgramState(_resolve(backend), stream=True)

        def body() -> None:
            try:
                self.func(state, *args, **kwargs)
            except BaseException as e:  # raised to the reader (text_iter, state["name"])
                state.close(error=e)
            else:
                state.close()

        threading.Thread(target=body, name="tessera-lang-program", daemon=True).start()
        return state

    def run_batch(self, batch_kwargs: Sequence[dict], *, backend: Any = None, num_threads: int = 16) -> list[ProgramState]:
        """Runs the program once per dict of arguments, concurrently (up to num_threads programs build their
        states at once; their gen calls batch in the engine). States come back in input order."""
        resolved = _resolve(backend)
        with ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="tessera-run-batch") as pool:
            states = list(pool.map(lambda kw: self._start(resolved, (), dict(kw)), batch_kwargs))
        for state in states:
            state.sync()
        return states

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any]) -> Program:
    """Decorator: `@tessera.function def prog(s, ...)`."""
    return Program(func)


def run_batch(program: Program, batch_kwargs: Sequence[dict], *, backend: Any = None,
              num_threads: int = 16) -> list[ProgramState]:
    return program.run_batch(batch_kwargs, backend=backend, num_threads=num_threads)


def fork(state: ProgramState, n: int = 1) -> ForkGroup:
    """n copies of `state` to continue separately (state.fork(n))."""
    return state.fork(n)
