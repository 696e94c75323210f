"""Few-row float32 products on the CPU through cpu_gemv.c (built by cpu_kernels.py).

A batch-1 decode step of bench-medium spent ~21 of its ~27 ms in its 48 projections, reading 389 MB of
weights at ~18 GB/s through oneDNN (MKL: ~13); this machine reads memory at ~28 GB/s. The C kernel streams
each weight once on torch's own OpenMP threads. Per-call medians (2-vCPU AMD EPYC, 2 threads, bench-medium's
12 layers x 4 projections, weights read from memory): 1 row 19.1 -> 13.3 ms (oneDNN -> this), 2 rows 36.3 ->
18.1, 8 rows 37.4 -> 26.8, 16 rows 53.6 -> 49.1, 32 rows 78.9 -> 86.3; on demo-vl's cache-resident weights
8 rows 172 -> 70 us per projection, 16 rows level with MKL on one thread, 32 rows slower: hence GEMV_MAX_ROWS.
"""

from __future__ import annotations

import torch

from tessera.layers import cpu_kernels

GEMV_MAX_ROWS = 8
# Below this many weight values a projection is cache-resident and small; torch's call is as quick and the
# tiny parity fixtures keep the reference path (tests/layers/test_cpu_kernels.py runs a model through this one).
GEMV_MIN_WEIGHT = 1 << 16


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` takes this product (float32 CPU inference, few rows, a large enough weight, shapes that
    agree: anything else goes to torch, which also raises torch's errors for bad shapes)."""
    return (x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and weight.numel() >= GEMV_MIN_WEIGHT
            and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and (bias is None or bias.shape == weight.shape[:1]) and cpu_kernels.takes(x, weight, bias))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the kernel; call only where `applies` said so."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    cpu_kernels.call("tessera_gemv_f32", x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                     y.data_ptr(), m, n, k, torch.get_num_threads())
    return y
