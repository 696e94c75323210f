"""The few-row product kernels (cpu_gemv.c, cpu_gemv16.c, cpu_int_gemv.c) built for every x86 level this CPU runs,
not only -march=native: plain x86-64 (GCC's vector extensions), x86-64-v3 (AVX2, 8 lanes, 4 x 2 tiles) and
x86-64-v4 (AVX-512, 16 lanes, 4 x 4 tiles, int4 widened 32 columns at a time). A machine runs one of these paths
in production; this runs each against a float64 product, across tile remainders and vector tails."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from tessera.layers.quantization.affine import quantize
from tessera.layers.quantization.int_linear import PackedIntWeight
from tessera.platform import cpu_kernels

CC = shutil.which("cc") or shutil.which("gcc")
# -march level -> the /proc/cpuinfo flags it needs to run
LEVELS = {"x86-64": (), "x86-64-v3": ("avx2", "fma", "f16c"), "x86-64-v4": ("avx512f", "avx512bw", "avx512vl")}
# rows of x: every remainder of the 2- and 4-row tiles, and past them
ROWS = (1, 2, 3, 4, 5, 7, 8, 13)


def _runnable(level: str) -> bool:
    return platform.machine() in ("x86_64", "AMD64") and all(f in cpu_kernels.cpu_flags() for f in LEVELS[level])


@pytest.fixture(scope="module", params=list(LEVELS))
def libs(request, tmp_path_factory):
    """{source: CDLL} built for one level (skipped where this CPU cannot run it or there is no compiler)."""
    level = request.param
    if CC is None or not _runnable(level):
        pytest.skip(f"no compiler, or this CPU does not run {level}")
    out = tmp_path_factory.mktemp(level)
    built = {}
    for source in ("cpu_gemv.c", "cpu_gemv16.c", "cpu_int_gemv.c"):
        lib = out / source.replace(".c", ".so")
        subprocess.run([CC, "-O2", f"-march={level}", "-fopenmp", "-shared", "-fPIC", str(cpu_kernels.CSRC / source),
                        "-lm", "-o", str(lib)], check=True, capture_output=True)
        built[source] = ctypes.CDLL(str(lib))
    return built


def _fn(lib: ctypes.CDLL, symbol: str, kernel: str):
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = cpu_kernels.KERNELS[kernel].argtypes, None
    return fn


def _check(y: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(y.double(), want, atol=2e-5 * float(want.abs().max()) + 1e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_float_kernels_at_every_level(libs, threads):
    g = torch.Generator().manual_seed(threads)
    for n, k in ((9, 40), (37, 1003), (64, 96)):  # block edges, 8- and 16-lane tails, whole vectors
        b = torch.randn(n, generator=g)
        w32 = torch.randn(n, k, generator=g) * 0.1
        for dtype, symbol, kernel, source in ((torch.float32, "tessera_gemv_f32", "gemv", "cpu_gemv.c"),
                                              (torch.bfloat16, "tessera_gemv_bf16", "gemv_bf16", "cpu_gemv16.c"),
                                              (torch.float16, "tessera_gemv_f16", "gemv_f16", "cpu_gemv16.c")):
            w = w32.to(dtype).contiguous()
            fn = _fn(libs[source], symbol, kernel)
            for m in ROWS:
                x = torch.randn(m, k, generator=g)
                y = torch.empty(m, n)
                bias = b if m % 2 else None
                fn(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                   threads)
                want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
                _check(y, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_int_kernels_at_every_level(libs, threads):
    g = torch.Generator().manual_seed(10 + threads)
    # (out, in, bits, group): int4 groups that take the 32-column widening (32, 128) and those that cannot (16,
    # 80); int8 per channel over a row that is no multiple of 16, and in groups
    for n, k, bits, group in ((37, 96, 4, 32), (20, 256, 4, 128), (18, 128, 4, 16), (10, 1040, 4, 80),
                              (37, 100, 8, None), (21, 600, 8, 40)):
        aw = quantize(torch.randn(n, k, generator=g) * 0.1, bits, group, bits == 8 and group is None)
        packed = PackedIntWeight(aw, "c")
        w = aw.dequantize().double()
        fn = _fn(libs["cpu_int_gemv.c"], f"tessera_int{bits}_gemv_f32", f"int{bits}_gemv")
        bias = torch.randn(n, generator=g)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, n)
            fn(x.data_ptr(), packed.q.data_ptr(), packed.scale.data_ptr(), packed.zs.data_ptr(), bias.data_ptr(),
               y.data_ptr(), m, n, k, packed.group_size, threads)
            _check(y, x.double() @ w.t() + bias.double())
