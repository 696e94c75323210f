"""A mode that fails, on a CPU, on what would break a CUDA-graph capture of the same code on a GPU.

A capture records kernels; it cannot record the host. Three things in a captured forward fail the capture
or make the graph wrong at replay, and all three can be seen without a GPU:

- a device-to-host read: `.item()`, `.tolist()`, `int()`/`float()`/`bool()` of a tensor (a Python `if` on a
  tensor is its `bool()`), `.cpu()`, `.numpy()`, `torch.equal`: a synchronisation, not allowed while capturing,
  and a replay would reuse the value read at capture;
- a tensor made on the host: `torch.tensor`/`as_tensor`/`from_numpy` of Python data, or a factory such as
  `torch.arange` without `device=` (a host tensor on CUDA): its copy to the device is a pageable transfer
  that a capture rejects, and a replay would reuse the data of the capture;
- an op whose output shape depends on values (nonzero, masked_select, boolean-mask indexing, unique,
  repeat_interleave without output_size, one-argument where, bincount): it reads a count back to size its
  output.

`graph_safe()` raises GraphSafetyError at the first such op, naming it and the innermost Python frame
outside torch that called it. Python-level calls are checked by a TorchFunctionMode (their names are the
ones the code used), everything that reaches an aten kernel by a TorchDispatchMode (ops inside torch's own
Python functions, and indexing with a tensor scalar, which calls `item`). A Triton kernel launch is exempt:
the launcher's host work happens outside a graph's kernels (under TRITON_INTERPRET=1 the interpreter even
copies every argument to the host and back), so the check is suspended inside one.

tests/worker/test_graph_safety.py runs every family's padded decode forward (worker/cuda_graph.py) under it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)

_READS = "reads the device back to the host (a sync a capture forbids; a replay would keep the captured value)"
_HOST = "makes a tensor on the host (its copy to the device cannot be captured; a replay keeps its data)"
_SHAPE = "has an output shape that depends on values (it reads a count back to the host)"


def _named(why: str, torch_names: str = "", tensor_names: str = "") -> dict[Callable, tuple[str, str]]:
    """function -> (the name the code used, why it breaks a capture), for torch.<name> and Tensor.<name>."""
    found = {getattr(torch, n): (f"torch.{n}", why) for n in torch_names.split()}
    found.update({getattr(torch.Tensor, n): (f"Tensor.{n}", why) for n in tensor_names.split()})
    return found


# Python-level calls, by the function object torch passes to the mode.
_FUNCTION_CHECKS: dict[Callable, tuple[str, str]] = {
    **_named(_READS, "equal", "item tolist __bool__ __int__ __float__ __index__ __complex__ cpu numpy"),
    **_named(_HOST, "tensor as_tensor asarray from_numpy", "new_tensor pin_memory"),
    **_named(_SHAPE, "nonzero argwhere masked_select unique unique_consecutive bincount",
             "nonzero argwhere masked_select unique unique_consecutive bincount"),
}
# Factories that make a tensor on the default device (the host, in a CUDA process) unless given device=.
_FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace, torch.logspace, torch.eye,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided, torch.tril_indices,
    torch.triu_indices, torch.scalar_tensor,
})
_aten = torch.ops.aten
_DISPATCH_CHECKS: dict[Any, str] = {
    _aten.item.default: _READS, _aten._local_scalar_dense.default: _READS, _aten.is_nonzero.default: _READS,
    _aten.equal.default: _READS,
    _aten.lift_fresh.default: _HOST, _aten.lift_fresh_copy.default: _HOST,
    _aten.nonzero.default: _SHAPE, _aten.nonzero_numpy.default: _SHAPE, _aten.argwhere.default: _SHAPE,
    _aten.masked_select.default: _SHAPE, _aten._unique.default: _SHAPE, _aten._unique2.default: _SHAPE,
    _aten.unique_dim.default: _SHAPE, _aten.unique_consecutive.default: _SHAPE,
    _aten.unique_dim_consecutive.default: _SHAPE, _aten.bincount.default: _SHAPE, _aten.where.default: _SHAPE,
}
_REPEAT_INTERLEAVE = frozenset({_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor})
_INDEXING = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                       _aten._index_put_impl_.default})


class GraphSafetyError(RuntimeError):
    """An op that a CUDA-graph capture cannot record, with the Python frame that called it."""


def _caller() -> str:
    """The innermost frame outside torch and this file, with its line: the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or os.path.abspath(frame.f_code.co_filename) == _THIS_FILE):
        frame = frame.f_back
    if frame is None:
        return "<no Python frame outside torch>"
    path = frame.f_code.co_filename
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}: {linecache.getline(path, frame.f_lineno).strip()}"


def _name(func: Any) -> str:
    qualname = getattr(func, "__qualname__", None) or str(func)
    return qualname.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")


class LaunchState:
    """What a kernel launch tells the modes around it: they pause inside one (`suspended`); `launched` gets
    each outermost launch's kernel name (bench/kernel_census.py counts them)."""

    def __init__(self, launched: Callable[[str], None] | None = None):
        self.suspended = 0  # > 0 inside a kernel launch
        self.launched = launched


class _Check:
    """What both modes share: the state a kernel launch suspends them through, and the raise. A mode's `why`
    gives (the op's name, why a capture cannot record it), or None when it can."""

    why: Callable[[Any, tuple, dict], tuple[str, str] | None]

    def __init__(self, state: LaunchState):
        super().__init__()
        self.state = state

    def _run(self, func, args, kwargs):
        kwargs = kwargs or {}
        found = None if self.state.suspended else self.why(func, args, kwargs)
        if found is not None:
            raise GraphSafetyError(f"{found[0]} {found[1]}, at {_caller()}")
        return func(*args, **kwargs)


class _FunctionCheck(_Check, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs)

    @staticmethod
    def why(func, args: tuple, kwargs: dict) -> tuple[str, str] | None:
        if func in _FUNCTION_CHECKS:
            return _FUNCTION_CHECKS[func]
        if func in _FACTORIES and kwargs.get("device") is None:
            return _name(func), _HOST + " (no device= given)"
        if func is torch.Tensor.to and _to_host(args, kwargs):
            return "Tensor.to", _READS
        return None


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Tensor.to(...) naming the CPU as a string ("cpu"): on a CPU run every device is the CPU, so only a
    literal can say the code means the host."""
    targets = [kwargs.get("device"), *args[1:2]]
    return any(isinstance(t, str) and t.startswith("cpu") for t in targets)


class _DispatchCheck(_Check, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs)

    @staticmethod
    def why(func, args: tuple, kwargs: dict) -> tuple[str, str] | None:
        if func in _DISPATCH_CHECKS:
            return str(func), _DISPATCH_CHECKS[func]
        if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            return str(func), _SHAPE + " (give output_size)"
        if func in _INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()):
            return str(func), _SHAPE + " (boolean-mask indexing; use torch.where or masked_fill)"
        return None


def _kernel_launchers() -> list[tuple[type, str]]:
    """(class, method) of each way a Triton kernel is launched: the interpreter's grid executor and the
    compiled launcher. Empty without triton."""
    try:
        from triton.runtime.interpreter import GridExecutor
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [(GridExecutor, "__call__"), (JITFunction, "run")]


@contextlib.contextmanager
def launches_exempt(state: LaunchState) -> Iterator[None]:
    """Inside the body every Triton launch suspends the modes that share `state` (and is reported to it)."""
    patched = []
    for cls, attr in _kernel_launchers():
        original = cls.__dict__[attr]

        def launch(self, *args, _original=original, **kwargs):
            if state.launched is not None and not state.suspended:
                fn = getattr(self, "fn", self)
                state.launched(getattr(fn, "__name__", type(fn).__name__))
            state.suspended += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                state.suspended -= 1

        setattr(cls, attr, launch)
        patched.append((cls, attr, original))
    try:
        yield
    finally:
        for cls, attr, original in patched:
            setattr(cls, attr, original)


@contextlib.contextmanager
def graph_safe() -> Iterator[None]:
    """Runs the body under the check: the first op a CUDA-graph capture could not record raises
    GraphSafetyError. Triton kernel launches inside are exempt (see the module docstring)."""
    state = LaunchState()
    with launches_exempt(state), _FunctionCheck(state), _DispatchCheck(state):
        yield
