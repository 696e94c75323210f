"""The tensor-parallel group of this process: its rank and size, and the collectives the model layers use.

torch.distributed carries every tensor (gloo on CPU, NCCL on CUDA). With one rank (the default) nothing is
initialised and every collective is the identity, so single-process code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tessera.platform.device import platform_of


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n rows; ValueError when n does not split."""
        if n % self.size:
            raise ValueError(f"{what}={n} does not split over tp_size={self.size}")
        per = n // self.size
        return self.rank * per, per


_TP = TPGroup()


def tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 300.0) -> None:
    """Joins the TP group (world = the TP ranks of one replica)."""
    global _TP
    if size > 1:
        dist.init_process_group(platform_of(device).dist_backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
    _TP = TPGroup(rank, size)


def destroy_tensor_parallel() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks, in place."""
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def min_over_ranks(n: int, device: torch.device) -> int:
    """The smallest n of all ranks (e.g. KV pool sizes, which must agree)."""
    if _TP.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=platform_of(device).collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """Rank 0's obj on every rank (pickled by torch.distributed; tensors inside travel in the pickle)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
