"""Few-row float32 products on the CPU through cpu_gemv.c (built by platform/cpu_kernels.py).

With few rows a product is bound by reading its weight, which oneDNN and MKL do well below the memory's
bandwidth; the C kernel streams each weight once on torch's own OpenMP threads. The row limits are where it
stopped winning inside whole decode steps (on one thread it loses from 32 rows: hence max_rows()). Figures:
docs/benchmarks.md, "C kernels for few-row products and RMSNorm" and, for the limits, "Decode attention over
the pool's pages, rotary and SwiGLU in C".
"""

from __future__ import annotations

import torch

from tessera.platform import cpu_kernels

GEMV_MAX_ROWS = 48  # with two or more threads
GEMV_MAX_ROWS_ONE_THREAD = 16
# Below this many weight values a projection is cache-resident and small; torch's call is as quick and the
# tiny parity fixtures keep the reference path (tests/layers/test_cpu_kernels.py runs a model through this one).
GEMV_MIN_WEIGHT = 1 << 16


def max_rows() -> int:
    """The most rows of x the kernel takes at the current intra-op thread count."""
    return GEMV_MAX_ROWS if torch.get_num_threads() > 1 else GEMV_MAX_ROWS_ONE_THREAD


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` takes this product (float32 CPU inference, few rows, a large enough weight, shapes that
    agree: anything else goes to torch, which also raises torch's errors for bad shapes)."""
    return (x.dim() == 2 and x.shape[0] <= max_rows() and weight.numel() >= GEMV_MIN_WEIGHT
            and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and (bias is None or bias.shape == weight.shape[:1]) and cpu_kernels.takes("gemv", x, weight, bias))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the kernel; call only where `applies` said so."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    cpu_kernels.call("gemv", x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     y.data_ptr(), m, n, k, torch.get_num_threads())
    return y
