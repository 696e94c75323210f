"""platform/host_memory.py: after keep_freed_blocks, a freed multi-megabyte block is reused without new page
faults (the point of it). glibc's own default moves its mmap threshold with use, so whether the default faults
depends on the process's history; the child therefore first pins glibc to mapping such blocks fresh (the
default's starting point, 128 KiB), checks that the measurement sees those faults, then calls
keep_freed_blocks. It runs in a child process, as the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import ctypes, resource, torch
from tessera.platform import host_memory
libc = ctypes.CDLL("libc.so.6")
libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
torch.set_num_threads(1)
x, w = torch.randn(256, 1024), torch.randn(4096, 1024)
def faults_of_a_step():  # a forward's shape of work: a 4 MiB product, an activation, freed at the end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = torch.nn.functional.linear(x, w)
    z = torch.nn.functional.silu(y) * y
    del y, z
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def settled():
    steps = [faults_of_a_step() for _ in range(8)]
    return min(steps[4:])  # the heap settles over the first steps
assert libc.mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD, fixed: every such block mapped fresh
mapped = settled()
assert host_memory.keep_freed_blocks()
print(mapped, settled())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TESSERA_MALLOC_KEEP": "1"})
    assert out.returncode == 0, out.stderr
    mapped, kept = map(int, out.stdout.split()[-2:])
    assert mapped >= 1000  # a 4 MiB block is 1,024 pages of 4 KiB: the count sees fresh mappings
    assert kept < 256


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_turned_off_it_changes_nothing():
    out = subprocess.run([sys.executable, "-c", "from tessera.platform import host_memory; "
                          "print(host_memory.keep_freed_blocks())"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TESSERA_MALLOC_KEEP": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"
