"""Linear layers whose parameters are allocated but not initialised (weights always come from a checkpoint).

MergedLinear stacks several projections of the same input (q/k/v, gate/up) into one matmul; the weight
loader fills each shard from the checkpoint's separate tensors via `load_shard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Projections of one input concatenated along the output dim, in the order of `output_sizes`."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in self.output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    @property
    def shard_ids(self) -> list[str]:
        return list(self.output_sizes)

    @torch.no_grad()
    def load_shard(self, param_name: str, shard_id: str, loaded: torch.Tensor) -> None:
        """Copies one checkpoint tensor (e.g. k_proj.bias) into its rows of `param_name` (weight/bias)."""
        param = getattr(self, param_name)
        offset, size = self.shard_offsets[shard_id]
        want = (size, *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"shard {shard_id!r} of {param_name}: checkpoint shape {tuple(loaded.shape)}, want {want}")
        param[offset:offset + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Output [..., out_features] -> one view per shard, in order."""
        return y.split(list(self.output_sizes.values()), dim=-1)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
