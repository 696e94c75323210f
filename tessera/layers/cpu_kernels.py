"""Our C kernels for the CPU (cpu_gemv.c: few-row products; cpu_rmsnorm.c: RMSNorm with the residual add;
cpu_decode_attention.c: decode attention over the paged pool; cpu_rotary.c: rotary embedding; cpu_silu_mul.c:
SwiGLU's activation), compiled on first use with the system's C compiler and loaded with ctypes.

The library is built once per source, compiler and CPU (-march=native) into TESSERA_KERNEL_CACHE (default
~/.cache/tessera/kernels; the temp dir when that is not writable). Why not torch's C++ extension builder: it
compiles against torch's headers (about a minute here, per torch version); these plain C files take about a
second and need only a C compiler with OpenMP. Without one, or with TESSERA_CPU_KERNELS=0, `library()` is None
and every caller stays with torch's own operators.
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

# Imported before the library is loaded, so that its libgomp dependency resolves to the OpenMP runtime torch
# already uses: one thread pool, not two competing for the cores.
import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f"{name}.c") for name in ("cpu_gemv", "cpu_rmsnorm", "cpu_decode_attention",
                                                                 "cpu_rotary", "cpu_silu_mul"))
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_SIGNATURES = {  # name: (argument types, result type)
    "tessera_gemv_f32": ([ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int], None),
    "tessera_rmsnorm_f32": ([ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int], None),
    "tessera_decode_attention_f32": ([ctypes.c_void_p] * 4 + [ctypes.c_long] + [ctypes.c_void_p] * 2
                                     + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_long, ctypes.c_int], None),
    "tessera_silu_mul_f32": ([ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_int],
                             None),
    "tessera_rotary_f32": ([ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_long]
                           + [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int], None),
}

_lock = threading.Lock()
_loaded: list = []  # [library or None] once loading was tried


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
    """Compiles the sources (unless these sources, compiler and CPU were built before); returns the library.
    Raises RuntimeError naming the reason when no compiler is found or compiling fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    parts = [s.read_bytes() for s in SOURCES + HEADERS] + [cc.encode(), " ".join(FLAGS).encode(), _cpu_tag().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = directory or cache_dir()
    lib = directory / f"tessera-cpu-{key}.so"
    if lib.exists():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-lm", "-o", str(tmp)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {', '.join(s.name for s in SOURCES)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: processes building at once each rename a complete file
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def _load():
    if os.environ.get("TESSERA_CPU_KERNELS", "1") == "0":
        return None
    try:
        try:
            path = build()
        except OSError:  # the cache dir is not writable
            path = build(Path(tempfile.gettempdir()) / f"tessera-kernels-{os.getuid()}")
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable, torch's operators are used instead: %s", e)
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def library():
    """The loaded kernels (built on the first call), or None where they are unavailable or disabled."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]


def takes(*tensors) -> bool:
    """Whether the kernels can take these operands (None entries skipped): float32, contiguous, on the CPU, in
    inference (they write no autograd graph), with the library built. Shapes are each caller's to check.
    A plain loop over cheap properties: this runs before every projection and norm of a decode step."""
    if torch.is_grad_enabled() or library() is None:
        return False
    for t in tensors:
        if t is not None and not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()):
            return False
    return True


def call(name: str, *args) -> None:
    """library().name(*args); while torch's profiler runs, inside a range named tessera::name (a ctypes call
    is invisible to it otherwise)."""
    fn = getattr(library(), name)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"tessera::{name}"):
            fn(*args)
    else:
        fn(*args)
