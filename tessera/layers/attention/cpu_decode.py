"""Decode attention in float32 on a CPU through our C kernel (tessera/layers/cpu_decode_attention.c).

torch's ops run a decode step's attention as q k^T, softmax and p v over the K/V mirror: batched GEMMs of
[G, D] x [D, L] tiles that take ~3x what reading K and V costs, plus a mask, a scale and a permutation per layer.
The kernel reads each (request, KV head)'s keys once for its whole query group, with an online softmax over
per-request lengths (no mask) and the mirror's row of each request (no permutation). Per layer, 2-vCPU AMD
EPYC, 2 threads: demo-vl's 64 requests x 100-200 keys 0.83-1.14 ms -> 0.26-0.40 ms, 1 request x 150 keys
73-106 us (matmuls; SDPA ~31-49) -> 14-17 us; 32 x 200-300 keys at 4 KV heads x 4 (bench-medium) 2.3-2.6 ->
1.0-1.1 ms. Outputs within ~1e-6 of torch's (another summation order).
"""

from __future__ import annotations

import torch

from tessera.layers import cpu_kernels

MAX_HEAD_DIM = 512  # the kernel's per-group accumulator is MAX_GROUP x MAX_HEAD_DIM floats on its stack
MAX_GROUP = 16


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q [B, Hkv, G, D] (any strides); k, v [rows, Hkv, L, D] whose last dim is contiguous (the mirror's views,
    or K/V gathered from the pool and transposed): float32 inference on a CPU, shapes the kernel handles."""
    head_dim, group = q.shape[-1], q.shape[-2]
    return (q.dim() == 4 and k.dim() == 4 and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP and k.stride() == v.stride() and k.stride(-1) == 1
            and k.shape[1] == q.shape[1] and k.shape[-1] == head_dim
            and cpu_kernels.takes() and all(t.is_cpu and t.dtype is torch.float32 for t in (q, k, v)))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                     rows: torch.Tensor | None, scaling: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hkv, G, D] -> [B, Hkv, G, D]: request b attends to keys [0, lens[b]) (the last
    `window` of them with a sliding window) of row rows[b] of k / v (rows None: row b). lens, rows: int64
    [B] on the CPU. Call only where `applies` said so."""
    batch, kv_heads, group, head_dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    cpu_kernels.call("tessera_decode_attention_f32", q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     None if rows is None else rows.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, kv_heads,
                     group, head_dim, k.stride(0), k.stride(1), k.stride(2), scaling, window or 0,
                     torch.get_num_threads())
    return out
