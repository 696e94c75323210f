"""Our C kernels for the CPU (csrc/*.c), built once per process at worker start and loaded with ctypes.

Each kernel is its own library, so a source that fails to compile disables that kernel alone; its callers
keep torch's operators (KERNELS names what each falls back to). Libraries are cached per source, compiler,
flags and CPU (-march=native) in TESSERA_KERNEL_CACHE (default ~/.cache/tessera/kernels, the temp dir when
that is not writable); a failed build is remembered there under the same key, so the other processes (TP
ranks, replicas, test workers) log one line instead of compiling again. `load()` runs at worker start and
`status()` is what get_server_info() reports. TESSERA_CPU_KERNELS=0 turns every kernel off.

Why not torch's C++ extension builder: it compiles against torch's headers (about a minute per torch
version); these plain C files take about a second and need only a C compiler with OpenMP.
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
from dataclasses import dataclass
from pathlib import Path

# Imported before a library is loaded, so that its libgomp dependency resolves to the OpenMP runtime torch
# already uses: one thread pool, not two competing for the cores.
import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
HEADERS = (CSRC / "cpu_vec.h",)  # included by every source: part of each build's key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 60  # one source; a compiler that hangs longer is treated as a failed build


@dataclass(frozen=True)
class Kernel:
    source: str
    symbol: str
    argtypes: tuple
    fallback: str  # what runs instead when the kernel is unavailable
    restype: object = None


_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
KERNELS: dict[str, Kernel] = {
    "gemv": Kernel("cpu_gemv.c", "tessera_gemv_f32", (_P,) * 4 + (_L,) * 3 + (_I,),
                   "few-row products through oneDNN or F.linear"),
    "rmsnorm": Kernel("cpu_rmsnorm.c", "tessera_rmsnorm_f32", (_P,) * 5 + (_L,) * 2 + (_F, _I),
                      "RMSNorm and the residual add as torch operators"),
    "decode_attention": Kernel("cpu_decode_attention.c", "tessera_decode_attention_f32",
                               (_P,) * 4 + (_L,) + (_P,) * 2 + (_L,) * 6 + (_F, _L, _I),
                               "decode attention over the decode K/V mirror with torch's matmuls"),
    "rotary": Kernel("cpu_rotary.c", "tessera_rotary_f32", (_P,) + (_L,) * 2 + (_P,) * 2 + (_L,) + (_P,) + (_L,) * 3
                     + (_I,), "rotary embedding as torch operators"),
    "silu_mul": Kernel("cpu_silu_mul.c", "tessera_silu_mul_f32", (_P, _L, _P) + (_L,) * 2 + (_I,),
                       "SwiGLU's silu(gate) * up as torch operators"),
    "gemv_bf16": Kernel("cpu_gemv16.c", "tessera_gemv_bf16", (_P,) * 4 + (_L,) * 3 + (_I,),
                        "bfloat16 weights widened to float32 by torch before the product"),
    "gemv_f16": Kernel("cpu_gemv16.c", "tessera_gemv_f16", (_P,) * 4 + (_L,) * 3 + (_I,),
                       "float16 weights widened to float32 by torch before the product"),
    # Weight-only int8 / int4 products (layers/quantization/int_linear.py): one source, five symbols.
    "int8_gemv": Kernel("cpu_int_gemv.c", "tessera_int8_gemv_f32", (_P,) * 6 + (_L,) * 4 + (_I,),
                        "int8 weights dequantized to float32 for each product"),
    "int4_gemv": Kernel("cpu_int_gemv.c", "tessera_int4_gemv_f32", (_P,) * 6 + (_L,) * 4 + (_I,),
                        "int4 weights dequantized to float32 for each product"),
    "int4_gemv_bf16x": Kernel("cpu_int_gemv.c", "tessera_int4_gemv_bf16x", (_P,) * 6 + (_L,) * 4 + (_I,),
                              "the int4 product over float32 x"),
    "int_dequant": Kernel("cpu_int_gemv.c", "tessera_int_dequant_f32", (_P,) * 4 + (_L,) * 3 + (_I,) * 2,
                          "dequantization as torch operators"),
    "int_dequant_bf16": Kernel("cpu_int_gemv.c", "tessera_int_dequant_bf16", (_P,) * 4 + (_L,) * 3 + (_I,) * 2,
                               "dequantization to float32, then rounding to bfloat16"),
    # A decode step of the whole decoder stack (layers/decode_stack.py): it calls the kernels above by address.
    "decode_stack": Kernel("cpu_decode_stack.c", "tessera_decode_stack_f32",
                           (_P, _P, _L) + (_P,) * 5 + (_L, _P, _P, _L, _P) + (_L,) * 6 + (_F, _F, _I, _P, _P, _L),
                           "the decoder layers one kernel call at a time", _I),
}

_lock = threading.Lock()
_functions: dict[str, object] = {}  # kernel name -> ctypes function, for the kernels that loaded
_errors: dict[str, str] = {}  # kernel name -> why it is unavailable
_loaded = False


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the platform's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, f16c, avx512_bf16, amx_bf16, ...); empty where
    they cannot be read. What the run-time kernel choices ask."""
    tag = _cpu_tag()
    return frozenset(tag.split(":", 1)[1].split()) if ":" in tag else frozenset()


def cache_dir() -> Path:
    if os.environ.get("TESSERA_KERNEL_CACHE"):
        return Path(os.environ["TESSERA_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessera" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return cc


def build(source: str, directory: Path | None = None) -> Path:
    """Compiles one source (unless it was built before with this compiler and CPU); returns its library.
    Raises RuntimeError naming the reason when no compiler is found or compiling fails, now or in an earlier
    process (the failure is kept next to the libraries under the same key)."""
    cc = _compiler()
    path = CSRC / source
    parts = [path.read_bytes(), *(h.read_bytes() for h in HEADERS), cc.encode(), " ".join(FLAGS).encode(),
             _cpu_tag().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = directory or cache_dir()
    lib = directory / f"tessera-{path.stem}-{key}.so"
    failed = lib.with_suffix(".failed")
    if lib.exists():
        return lib
    if failed.exists():
        raise RuntimeError(f"{source} failed to build earlier ({failed}): {failed.read_text().strip()}")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        try:
            done = subprocess.run([cc, *FLAGS, str(path), "-lm", "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            error = None if done.returncode == 0 else f"{cc} failed: {done.stderr.strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            error = f"{cc} took over {BUILD_TIMEOUT_S} s"
        if error is not None:
            failed.write_text(error)
            raise RuntimeError(f"{source}: {error}")
        os.replace(tmp, lib)  # atomic: processes building at once each rename a complete file
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def _load_one(name: str, kernel: Kernel) -> None:
    try:
        try:
            path = build(kernel.source)
        except OSError:  # the cache dir is not writable
            path = build(kernel.source, Path(tempfile.gettempdir()) / f"tessera-kernels-{os.getuid()}")
        fn = getattr(ctypes.CDLL(str(path)), kernel.symbol)
    except (RuntimeError, OSError, AttributeError) as e:
        _errors[name] = str(e).splitlines()[0][:300]
        return
    fn.argtypes, fn.restype = list(kernel.argtypes), kernel.restype
    _functions[name] = fn


def load() -> dict[str, str]:
    """Builds and loads every kernel once per process (later calls return at once); returns status()."""
    global _loaded
    with _lock:
        if not _loaded:
            if os.environ.get("TESSERA_CPU_KERNELS", "1") == "0":
                _errors.update({name: "disabled by TESSERA_CPU_KERNELS=0" for name in KERNELS})
            else:
                for name, kernel in KERNELS.items():
                    _load_one(name, kernel)
            for name, error in _errors.items():
                logger.warning("CPU kernel %s unavailable (%s); instead: %s", name, error, KERNELS[name].fallback)
            _loaded = True
    return status()


def status() -> dict[str, str]:
    """Per kernel: "loaded", or why not and what runs instead (reported by get_server_info)."""
    if not _loaded:
        return {name: "not loaded yet" for name in KERNELS}
    return {name: "loaded" if name in _functions else f"unavailable ({_errors[name]}); instead: {k.fallback}"
            for name, k in KERNELS.items()}


def available(name: str) -> bool:
    if not _loaded:
        load()
    return name in _functions


def host_f32_inference(*tensors, contiguous: bool = True) -> bool:
    """Whether these operands (None entries skipped) are float32 host tensors (contiguous unless told) in
    inference: what our kernels and oneDNN's fused linear take (they write no autograd graph). A plain loop
    over cheap properties: this runs before every projection and norm of a decode step."""
    if torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and not (t.is_cpu and t.dtype is torch.float32 and (not contiguous or t.is_contiguous())):
            return False
    return True


def takes(name: str, *tensors) -> bool:
    """Whether kernel `name` is loaded and can take these operands (host_f32_inference). Shapes are each
    caller's to check."""
    return available(name) and host_f32_inference(*tensors)


def call(name: str, *args):
    """Kernel `name` on `args` (returns what it returns: None for most); while torch's profiler runs, inside a
    range named tessera::<symbol> (a ctypes call is invisible to it otherwise). Call only where `takes` (or
    `available`) said so."""
    if not _loaded:
        load()
    fn = _functions[name]
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"tessera::{KERNELS[name].symbol}"):
            return fn(*args)
    return fn(*args)


def addresses() -> dict[str, int]:
    """The loaded kernels' entry points by name, as integers (what a C driver calling them takes)."""
    if not _loaded:
        load()
    return {name: ctypes.cast(fn, ctypes.c_void_p).value for name, fn in _functions.items()}


def onednn_linear():
    """oneDNN's fused linear (a private torch op: looked up once here, None where this torch lacks it)."""
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return torch.ops.mkldnn._linear_pointwise
    return None
