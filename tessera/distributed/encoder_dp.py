"""The data-parallel vision encoder (SGLang's --mm-enable-dp-encoder): under tensor parallelism every rank
holds the whole tower, so instead of each rank encoding every item, the step's items are shared out by
size, each rank encodes its share, and one all_gather puts every embedding on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tessera.distributed.parallel_state import tp_group
from tessera.platform.device import platform_of


def dp_encoder_assignment(sizes: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Greedy longest-processing-time: items largest first, each to the rank with the least load so far
    (lowest rank on ties). Returns each rank's item indices in ascending order. Deterministic, so every
    rank computes the same assignment."""
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(s) for s in shares]


def dp_sharded_encode(encoder: Callable[[list], list[torch.Tensor]], items: list, rows: Sequence[int],
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """encoder(items) computed across the TP ranks: items[i] yields rows[i] embedding rows (its placeholder
    count, also its load). Returns every item's embedding, in order, on every rank."""
    tp = tp_group()
    if tp.size == 1 or len(items) < 2:
        return encoder(items)
    shares = dp_encoder_assignment(rows, tp.size)
    mine = shares[tp.rank]
    local = encoder([items[i] for i in mine]) if mine else []
    # Ranks agree on the row counts from the assignment; the width is whatever the encoder made.
    width = torch.tensor([local[0].shape[-1] if local else 0], device=_comm_device(device))
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    totals = [sum(rows[i] for i in share) for share in shares]
    padded = torch.zeros(max(totals), int(width.item()), dtype=dtype, device=device)
    if local:
        flat = torch.cat([e.to(dtype) for e in local])
        padded[: flat.shape[0]] = flat
    parts = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(parts, padded)
    out: list[torch.Tensor | None] = [None] * len(items)
    for share, part in zip(shares, parts):
        offset = 0
        for i in share:
            out[i] = part[offset:offset + rows[i]]
            offset += rows[i]
    return out  # type: ignore[return-value]


def _comm_device(device: torch.device) -> torch.device:
    return platform_of(device).collective_device(device)
