"""Decode attention in float32 on a CPU, reading the paged KV pool in place through our C kernel
(tessera/platform/csrc/cpu_decode_attention.c).

torch's ops need each request's K/V contiguous: the backend kept a second copy of them across steps (the decode
mirror) and ran q k^T, softmax and p v over it as batched GEMMs of [G, D] x [D, L] tiles, ~3x the time reading
K and V takes, plus a mask, a scale and a permutation per layer. The kernel reads each request's keys through
its slot table, once for its whole query group, with an online softmax over per-request lengths: no copy, no
mask, no permutation, no mirror memory. Decode steps in one process, alternating blocks of 20 (2-vCPU AMD
EPYC, 2 threads, demo-vl, 100-token prompts), torch over the mirror -> this kernel over the pool: batch 64
16.65 -> 14.87 ms, batch 16 8.16 -> 7.28, batch 1 3.59 -> 3.17. Outputs within ~1e-6 of torch's (another
summation order). More in docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.platform import cpu_kernels

MAX_HEAD_DIM = 512  # the kernel's accumulators are MAX_ROWS x MAX_HEAD_DIM floats on its stack
MAX_GROUP = 16  # query heads per KV head (the kernel's MAX_ROWS)


def reads_pool(q: torch.Tensor, pool: TokenToKVPool) -> bool:
    """Whether the kernel takes this step's decode attention: q [tokens, heads, D] and the pool in float32 on
    a CPU, in inference (the kernel records no autograd graph), a head size and grouping it handles."""
    return (cpu_kernels.host_f32_inference(q, contiguous=False) and q.shape[-1] == pool.head_dim
            and pool_readable(q.shape[1], pool))


def pool_readable(num_heads: int, pool: TokenToKVPool) -> bool:
    """Whether the kernel reads this pool for `num_heads` query heads (reads_pool without a query at hand)."""
    k = pool.k_buffers[0]
    return (cpu_kernels.host_f32_inference(k) and pool.head_dim % 8 == 0 and pool.head_dim <= MAX_HEAD_DIM
            and num_heads % pool.num_kv_heads == 0 and num_heads // pool.num_kv_heads <= MAX_GROUP
            and cpu_kernels.takes("decode_attention"))


def paged_decode_attention(q: torch.Tensor, pool: TokenToKVPool, layer: int, slots: torch.Tensor,
                           lens: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hkv, G, D] -> [B, Hkv, G, D]: request b attends to its keys [0, lens[b]) (the last `window` of
    them with a sliding window), key j in slot slots[b, j] of layer `layer`. slots: int64 [B, >= max(lens)]
    with contiguous rows (entries past lens[b] are never read); lens: int64 [B]. Call only where `reads_pool`
    said so."""
    batch, kv_heads, group, head_dim = q.shape
    k, v = pool.k_buffers[layer], pool.v_buffers[layer]  # [slots, Hkv, D]
    assert slots.dtype is torch.int64 and slots.stride(-1) == 1 and lens.dtype is torch.int64
    q = q.contiguous()
    out = torch.empty_like(q)
    cpu_kernels.call("decode_attention", q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                     slots.stride(0), lens.data_ptr(), out.data_ptr(), batch, kv_heads, group, head_dim, k.stride(0),
                     k.stride(1), scaling, window or 0, torch.get_num_threads())
    return out
