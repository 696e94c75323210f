"""platform/host_memory.py: after keep_freed_blocks, a freed multi-megabyte block is reused without new page
faults (the point of it); without it, glibc maps fresh zero pages for each. Each case runs in a child process, as
the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from tessera.platform import host_memory
keep = sys.argv[1] == "1"
assert host_memory.keep_freed_blocks() is keep
torch.set_num_threads(1)
x, w = torch.randn(256, 1024), torch.randn(4096, 1024)
def faults_of_a_step():  # a forward's shape of work: a 4 MiB product, an activation, freed at the end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = torch.nn.functional.linear(x, w)
    z = torch.nn.functional.silu(y) * y
    del y, z
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
steps = [faults_of_a_step() for _ in range(8)]
print(min(steps[4:]))  # the heap settles over the first steps
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    def faults(keep: bool) -> int:
        env = {"TESSERA_MALLOC_KEEP": "1" if keep else "0"}
        out = subprocess.run([sys.executable, "-c", CHILD, "1" if keep else "0"], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    assert faults(keep=True) < 256  # a 4 MiB block is 1,024 pages of 4 KiB
    assert faults(keep=False) >= 1000
