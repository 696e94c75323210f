"""The device layer: the one place that asks which kind of device a tensor or a worker is on.

Everything else asks a `Platform` what it can do (pinned staging, graphs, its collective backend, its memory)
instead of testing `device.type`. Adding a device kind (XPU, MPS, ROCm's HIP) is a subclass here plus the
attention/ops choice in layers/attention; the rest of the engine is unchanged (vLLM's `current_platform`
plays the same part).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Platform:
    """A device kind's answers. The base is the host (CPU): no pinned staging, no graphs, gloo."""

    kind = "cpu"
    dist_backend = "gloo"
    # Host memory is what a pinned buffer would be: staging through one buys nothing.
    pinned_staging = False
    supports_graphs = False
    varlen_attention = False  # packed variable-length attention kernels (vision towers) exist for this device
    # The model's kernels run on the host's cores, so the scheduler's thread policy applies to them, and a
    # worker's own preprocessing competes with its steps.
    runs_on_host_cores = True
    # Whether a bfloat16/float16 model computes in 16 bits. On a CPU it does not: the weights stay 16-bit (half
    # the memory, half the bytes a decode step reads), activations, norms and the KV pool are float32, because
    # without AMX torch's 16-bit matmuls are slower than float32 ones (docs/benchmarks.md, "16-bit weights on
    # a CPU"); layers/half_linear.py runs the products.
    computes_16bit = False
    # The layers' elementwise work runs as fused Triton kernels (layers/triton_ops.py) rather than torch ops.
    runs_triton = False

    def bind(self, device: torch.device) -> None:
        """Makes `device` the process's current device (a rank on cuda:1 must not allocate on cuda:0)."""

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) bytes of the device's memory, None where the engine does not size pools from it."""
        return None

    def synchronize(self, device: torch.device) -> None:
        """Waits for the device's queued work."""

    def collective_device(self, device: torch.device) -> torch.device:
        """Where tensors for this platform's collective backend live."""
        return torch.device("cpu")

    def is_capturing(self) -> bool:
        """Whether the current stream is recording a graph (planning must then not touch the host)."""
        return False

    def capture_graphs(self, fns: dict[int, Callable[[], None]], warmup: int = 2,
                       before: Callable[[int], None] | None = None) -> dict[int, object]:
        """One replayable graph per key, each recording one call of its function; `before(key)` runs ahead of
        every call of fns[key], outside the capture."""
        raise RuntimeError(f"graphs are not supported on {self.kind}")

    def step_clock(self) -> StepClock:
        """Times the device's model steps and the gaps between them (see StepClock)."""
        return StepClock()

    def parallel_units(self, device: torch.device) -> int | None:
        """How many programs the device runs at once (a GPU's streaming multiprocessors); None: not known."""
        return None

    def side_stream(self, device: torch.device) -> SideStream:
        """Where a background thread's device work runs beside the steps (see SideStream)."""
        return SideStream()

    def start_read(self, tensors: Sequence[torch.Tensor]) -> HostRead:
        """Starts bringing a step's results to the host without waiting for the step (see HostRead)."""
        return HostRead(list(tensors))


class HostRead:
    """A step's device results on their way to the host; `wait()` gives the host tensors. On the host they are
    the tensors themselves, at once (the step has run by the time it returns)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._tensors = tensors

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class CudaHostRead(HostRead):
    """Non-blocking copies into pinned host memory queued behind the step's kernels, and an event after them:
    the host is free to form the next step until `wait()` (the overlap scheduler's read-back)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__([torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors])
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        self._event.synchronize()
        return self._tensors


class SideStream:
    """A background thread's device work beside the model steps (the encode-ahead thread's vision tower), and
    the hand-off of its results to the step. On the host a result is ready when the thread's call returns:
    nothing to order. `scope` wraps the thread's call, `done` (the thread, after it) marks its results, and
    `receive` (the step's thread, before the step uses a result) orders the step after the mark."""

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def done(self) -> object | None:
        return None

    def receive(self, tensor: torch.Tensor, mark: object | None) -> torch.Tensor:
        return tensor


class CudaSideStream(SideStream):
    """The thread's kernels on a stream of their own, so that they run while the steps' kernels run (SGLang
    overlaps its encoders the same way); an event marks each call's end."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def scope(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def done(self) -> object | None:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def receive(self, tensor: torch.Tensor, mark: object | None) -> torch.Tensor:
        current = torch.cuda.current_stream(tensor.device)
        if mark is not None:
            current.wait_event(mark)  # type: ignore[arg-type]
        # The tensor's memory belongs to the side stream's allocator pool: without this it could be handed out
        # again there while the steps still read it.
        tensor.record_stream(current)
        return tensor


class StepClock:
    """How long the device computed model steps, and how long it sat idle between consecutive ones (the host
    work of the scheduler, the sampler's read-back, building the next step's input): the time an overlap of host
    and device work could win back. `begin()` as a step's first work is queued, `end()` once its results were
    read back (the device has finished it), `idle()` when the scheduler had nothing to run (the gap that
    follows is not counted). On the host, wall-clock times; CudaStepClock times the device itself."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._last_end: float | None = None
        self._begin = 0.0

    def begin(self) -> None:
        self._begin = time.perf_counter()
        if self._last_end is not None:
            self.idle_s += max(0.0, self._begin - self._last_end)

    def end(self) -> None:
        self._last_end = time.perf_counter()
        self.busy_s += self._last_end - self._begin

    def idle(self) -> None:
        self._last_end = None

    def times(self) -> tuple[float, float]:
        """(busy, idle between steps) in seconds so far."""
        return self.busy_s, self.idle_s


class CudaStepClock(StepClock):
    """StepClock from CUDA events on the current stream: a step's busy time is the span of its work on the
    device, an idle gap runs from the previous step's end to this step's first kernel. `begin` and `end` bracket
    the queuing of a step, the events time its run. Steps are read once their events have completed, oldest
    first: the overlap scheduler queues step N+1 while step N still runs, and reading N then would wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self._start = None
        self._pending: deque = deque()  # (start, stop) of steps not yet read, oldest first
        self._prev_stop = None

    def begin(self) -> None:
        self._settle(wait=False)
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._pending.append((self._start, stop))

    def idle(self) -> None:
        self._settle(wait=True)  # no step is in flight when the scheduler pauses: nothing waits long
        self._prev_stop = None

    def times(self) -> tuple[float, float]:
        self._settle(wait=False)  # a step still running is counted once it has finished
        return self.busy_s, self.idle_s

    def _settle(self, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            start, stop = self._pending.popleft()
            stop.synchronize()
            self.busy_s += start.elapsed_time(stop) / 1e3
            if self._prev_stop is not None:
                self.idle_s += max(0.0, self._prev_stop.elapsed_time(start) / 1e3)
            self._prev_stop = stop


class CudaPlatform(Platform):
    kind = "cuda"
    dist_backend = "nccl"
    pinned_staging = True
    supports_graphs = True
    varlen_attention = True
    runs_on_host_cores = False
    computes_16bit = True
    runs_triton = True

    def bind(self, device: torch.device) -> None:
        # What names no device uses the current one: new streams and graph pools, Triton launches, NCCL's
        # buffers for broadcast_object; without this, a rank on cuda:1 runs them on cuda:0.
        torch.cuda.set_device(device)

    def memory_info(self, device: torch.device) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def collective_device(self, device: torch.device) -> torch.device:
        return device

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def step_clock(self) -> StepClock:
        return CudaStepClock()

    def parallel_units(self, device: torch.device) -> int | None:
        return torch.cuda.get_device_properties(device).multi_processor_count

    def side_stream(self, device: torch.device) -> SideStream:
        return CudaSideStream(device)

    def start_read(self, tensors: Sequence[torch.Tensor]) -> HostRead:
        return CudaHostRead(list(tensors))

    def capture_graphs(self, fns: dict[int, Callable[[], None]], warmup: int = 2,
                       before: Callable[[int], None] | None = None) -> dict[int, object]:
        """Captures on a side stream into one shared memory pool (graphs captured largest first can reuse
        the pool's blocks for the smaller ones); each function is run `warmup` times eagerly first so lazy
        initialisation (cuBLAS handles, Triton's compiles) happens outside the capture."""
        graphs: dict[int, object] = {}
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in sorted(fns, reverse=True):
                for run in range(warmup + 1):  # the last `before` plans the captured run
                    if before is not None:
                        before(key)
                    if run < warmup:
                        fns[key]()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    fns[key]()
                graphs[key] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return graphs


_PLATFORMS: dict[str, Platform] = {"cpu": Platform(), "cuda": CudaPlatform()}


def platform_of(device: torch.device | str) -> Platform:
    """The platform of a device (or of the device a tensor is on: pass `t.device`)."""
    kind = torch.device(device).type
    if kind not in _PLATFORMS:
        raise ValueError(f"device: {kind!r} is not supported (supported: {', '.join(sorted(_PLATFORMS))})")
    return _PLATFORMS[kind]


def is_host(device: torch.device | str) -> bool:
    """Whether tensors on `device` already live in host memory (no copy needed to read or keep them)."""
    return torch.device(device).type == "cpu"


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda:0 when available, else cpu; "cuda" without CUDA -> ValueError in one line.

    An accelerator always comes back with its index ("cuda" -> cuda:0, as SGLang's gpu_id 0): torch's
    set_device, and every call that must name one device, refuse a device without an index, and "the current
    device" means nothing to a process that has not chosen one yet (CUDA_VISIBLE_DEVICES picks which GPU is 0)."""
    name = str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not (name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"device: expected auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ValueError(f"device: {name!r} requested but no CUDA device is available ({build}); "
                         "use --device cpu or --device auto")
    return torch.device("cuda", 0) if name == "cuda" else torch.device(name)


def rank_device(device: torch.device, index: int) -> torch.device:
    """The device of the rank whose accelerator index is `index` (ranks share the host when it is a CPU)."""
    return device if is_host(device) else torch.device(device.type, index)


def resolve_dtype(dtype: torch.dtype | str, checkpoint_dtype: str | None = None,
                  device: torch.device | str = "cpu") -> torch.dtype:
    """torch dtype, or "float32"/"float16"/"bfloat16", or "auto": the checkpoint's dtype (float32 when the
    checkpoint records none). This is the weights' dtype; compute_dtype says what the model computes in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # A float16 checkpoint stays float16 on a CPU too: its weights are widened to float32 in registers
        # there (Platform.computes_16bit), so nothing is rounded to another format.
        return _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def compute_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype of activations, norms and the KV pool for a model whose weights are `dtype` (see
    Platform.computes_16bit): the same dtype, or float32 for 16-bit weights on a platform that widens them."""
    if dtype in (torch.float16, torch.bfloat16) and not platform_of(device).computes_16bit:
        return torch.float32
    return dtype


def to_host(value: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor (pinned when it comes from an accelerator, so it can go back asynchronously);
    the tensor itself when it already lives on the host."""
    if is_host(value.device):
        return value
    if isinstance(value, torch.Tensor) and platform_of(value.device).pinned_staging:
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value)
    return value.to("cpu")


def to_device_packed(parts: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The host tensors `parts` on `device`, the same bits. Where the platform stages through pinned memory
    they travel in one non-blocking copy out of one pinned buffer (one pageable copy each is a synchronous
    transfer each: a step has a dozen small inputs and ~8 sampling rows); the device tensors are views of
    its result. Elsewhere each part is moved by its own `.to` (on the host: not at all)."""
    device = torch.device(device)
    if not platform_of(device).pinned_staging:
        return [p.to(device) for p in parts]
    return pack_and_copy(parts, device, pin=True)


def pack_and_copy(parts: Sequence[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """to_device_packed's copy: the parts' bytes laid end to end in one (pinned) host buffer, widest
    elements first so every part starts at a multiple of its element size (a view of another dtype needs
    that), copied once; each part is a view of the copy. A fresh buffer per call: torch's pinned-memory
    cache hands a block out again only after the copies that read it have finished."""
    order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
    host = torch.empty(sum(p.nbytes for p in parts), dtype=torch.uint8, pin_memory=pin)
    starts, at = [0] * len(parts), 0
    for i in order:
        starts[i], at = at, at + parts[i].nbytes
        host[starts[i]:at] = parts[i].contiguous().view(-1).view(torch.uint8)
    flat = host.to(device, non_blocking=True)
    return [flat[starts[i]:starts[i] + p.nbytes].view(p.dtype).view(p.shape) for i, p in enumerate(parts)]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are allocated in the target dtype directly (no float32 copy of a large model)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
