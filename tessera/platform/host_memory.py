"""glibc's malloc told to keep the blocks a CPU forward frees, in a process that runs a model on host cores.

By default glibc serves every block over 128 KiB-32 MiB (its threshold grows with use) with a fresh mmap and
returns it at free, and trims its heap top past 128 KiB: a CPU forward's multi-megabyte temporaries (a
prefill's MLP activations, a linear's output) come back each step as zero-filled pages, one page fault per
4 KiB. On a virtual machine those faults are dear: a 256-token prefill of bench-medium spent 23-37 ms of its
218-238 ms in the SwiGLU kernel's first writes to its fresh output (6-10 ms with blocks kept), and the whole
prefill went from 1,073-1,172 to 1,288-1,313 tok/s (docs/benchmarks.md, "AVX-512"). What SGLang's and vLLM's CPU
backends get from preloading tcmalloc or jemalloc, here from two mallopt calls: blocks up to 32 MiB (glibc's
largest threshold) come from the heap, and the heap is never trimmed, so the freed ones are reused.

The cost is memory: what a step frees stays in the process (RSS holds the largest step's temporaries). It is
applied after the weights load, so their staging copies are not kept. TESSERA_MALLOC_KEEP=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # the largest an int parameter takes: never trim


def keep_freed_blocks() -> bool:
    """Sets the two thresholds; False (and nothing changed) off glibc or when turned off."""
    if os.environ.get("TESSERA_MALLOC_KEEP", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    logger.debug("malloc keeps freed blocks up to %d MiB: %s", MMAP_THRESHOLD >> 20, ok)
    return ok
