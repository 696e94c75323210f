"""Few-row float32 products on the CPU through cpu_gemv.c (built by cpu_kernels.py).

A batch-1 decode step of bench-medium spent ~21 of its ~27 ms in its 48 projections, reading 389 MB of
weights at ~18 GB/s through oneDNN (MKL: ~13); this machine reads memory at ~28 GB/s. The C kernel streams
each weight once on torch's own OpenMP threads. Per-call medians (2-vCPU AMD EPYC, 2 threads, bench-medium's
12 layers x 4 projections, weights read from memory): 1 row 19.1 -> 13.3 ms (oneDNN -> this), 2 rows 36.3 ->
18.1, 8 rows 37.4 -> 26.8, 16 rows 53.6 -> 49.1. Inside whole decode steps (one process alternating blocks of
20 steps, 2 threads) it kept winning past the 8 rows first chosen from isolated calls: demo-vl batch 12 6.19 ->
4.34 ms per step with the limit at 16, batch 32 12.50 -> 10.27 at 32, batch 48 16.60 -> 15.46 at 64, batch 64
level; bench-medium batch 16 78.1 -> 70.8, batch 32 113.0 -> 109.2. On one thread it loses from 32 rows
(demo-vl batch 32 17.4 -> 18.5 ms, batch 48 21.0 -> 22.6): hence max_rows().
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
