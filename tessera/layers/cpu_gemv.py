"""Few-row float32 products on the CPU through cpu_gemv.c, compiled on first use with the system's C compiler.

A batch-1 decode step of bench-medium spent ~21 of its ~27 ms in its 48 projections, reading 389 MB of
weights at ~18 GB/s through oneDNN (MKL: ~13); this machine reads memory at ~28 GB/s. The C kernel streams
each weight once on torch's own OpenMP threads. Per-call medians (2-vCPU AMD EPYC, 2 threads, bench-medium's
12 layers x 4 projections, weights read from memory): 1 row 19.1 -> 13.3 ms (oneDNN -> this), 2 rows 36.3 ->
18.1, 8 rows 37.4 -> 26.8, 16 rows 53.6 -> 49.1, 32 rows 78.9 -> 86.3; on demo-vl's cache-resident weights
8 rows 172 -> 70 us per projection, 16 rows level with MKL on one thread, 32 rows slower: hence GEMV_MAX_ROWS.

The library is built once per source, compiler and CPU (-march=native) into TESSERA_KERNEL_CACHE (default
~/.cache/tessera/kernels). Without a compiler, or with TESSERA_CPU_GEMV=0, `gemv_function()` is None and
every product stays with torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GEMV_MAX_ROWS = 8
# Below this many weight values a projection is cache-resident and small; torch's call is as quick and the
# tiny parity fixtures keep the reference path (tests/layers/test_cpu_gemv.py runs a model through this one).
GEMV_MIN_WEIGHT = 1 << 16
SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: list = []  # [function or None] once loading was tried


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the platform's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    if os.environ.get("TESSERA_KERNEL_CACHE"):
        return Path(os.environ["TESSERA_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessera" / "kernels"


def build(directory: Path | None = None) -> Path:
    """Compiles cpu_gemv.c (unless this source, compiler and CPU were built before); returns the library.
    Raises RuntimeError naming the reason when no compiler is found or compiling fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(), _cpu_tag().encode()]))
    directory = directory or cache_dir()
    lib = directory / f"cpu_gemv-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: processes building at once each rename a complete file
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def _load():
    if os.environ.get("TESSERA_CPU_GEMV", "1") == "0":
        return None
    try:
        try:
            lib = build()
        except OSError:  # the cache dir is not writable: build in the temp dir
            lib = build(Path(tempfile.gettempdir()) / f"tessera-kernels-{os.getuid()}")
        # Loaded after torch, so its libgomp dependency resolves to the OpenMP runtime torch already uses
        # (one thread pool, not two competing for the cores).
        fn = ctypes.CDLL(str(lib)).tessera_gemv_f32
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode projections stay with torch: %s", e)
        return None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    return fn


def gemv_function():
    """The compiled kernel (loading it on the first call), or None where it is unavailable or disabled."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` takes this product (float32 CPU inference, few rows, a large enough weight, shapes that
    agree: anything else goes to torch, which also raises torch's errors for bad shapes)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
            and weight.numel() >= GEMV_MIN_WEIGHT and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == weight.shape[:1]
                                  and bias.is_contiguous()))
            and not torch.is_grad_enabled() and gemv_function() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the kernel; call only where `applies` said so."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    gemv_function()(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                    m, n, k, torch.get_num_threads())
    return y
