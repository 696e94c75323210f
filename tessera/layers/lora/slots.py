"""The LoRA stacks of one linear layer and the batched product that adds them to its output.

Every adapter a step may use sits in a slot (the pool: `--max-loras-per-batch` slots, written by the worker
when the scheduler assigns an adapter to one); a layer an adapter does not target holds zeros in its slot. A
merged linear (QKV, gate-up) holds its shards' A matrices stacked along the rank, [slots, shards * rank, in],
and their B matrices block-diagonally, [slots, out, shards * rank], so each row is one shrink and one expand
product whatever the shards; B carries the adapter's scaling (alpha / r), folded in when it is placed.

The step's rows are grouped by slot (Punica / S-LoRA's segments): each group is one pair of products, over a
slice of rows where the group's requests are adjacent, gathered rows otherwise. Rows of requests without an
adapter are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraStep:
    """The current forward's rows per slot, set by the worker around the model's forward and read by every
    layer's LoraSlots (a scoped hand-off: None outside a step, and during a step without adapter rows)."""

    groups: list[tuple[int, slice | torch.Tensor]] | None = None
    # Per token row: its slot (-1: base model); what the Triton kernel takes instead of groups (CUDA).
    row_slots: torch.Tensor | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, first row, end row), in order

    def set_rows(self, req_slots: list[int], extend_lens: list[int], device: torch.device) -> None:
        """Groups the step's token rows (requests' new tokens, flattened in order) by their request's slot."""
        self.segments, start = [], 0
        for slot, n in zip(req_slots, extend_lens):
            if slot >= 0 and n > 0:
                if self.segments and self.segments[-1][0] == slot and self.segments[-1][2] == start:
                    self.segments[-1] = (slot, self.segments[-1][1], start + n)
                else:
                    self.segments.append((slot, start, start + n))
            start += n
        if not self.segments:
            self.groups = None
            return
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, lo, hi in self.segments:
            by_slot.setdefault(slot, []).append((lo, hi))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in by_slot.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                rows = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
                groups.append((slot, rows.to(device, non_blocking=True)))
        self.groups = groups

    def clear(self) -> None:
        self.groups, self.segments = None, []


class LoraSlots:
    """A linear layer's A/B stacks (see the module docstring). `shard_sizes`: this rank's output rows per shard
    (one entry for a plain linear); `rank`: the per-shard rank the stacks hold, grown when an adapter needs
    more (ranks below it are zero-padded, which adds nothing to the product)."""

    def __init__(self, step: LoraStep, num_slots: int, in_features: int, shard_sizes: list[int],
                 dtype: torch.dtype, device: torch.device):
        self.step, self.num_slots, self.in_features = step, num_slots, in_features
        self.shard_sizes = shard_sizes
        self.rank = 0
        self.dtype, self.device = dtype, device
        self.A = torch.zeros(num_slots, 0, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(num_slots, sum(shard_sizes), 0, dtype=dtype, device=device)

    def ensure_rank(self, rank: int) -> None:
        if rank <= self.rank:
            return
        n = len(self.shard_sizes)
        A = torch.zeros(self.num_slots, n * rank, self.in_features, dtype=self.dtype, device=self.device)
        B = torch.zeros(self.num_slots, sum(self.shard_sizes), n * rank, dtype=self.dtype, device=self.device)
        for s in range(n):  # keep what the slots hold, each shard's block at its new place
            A[:, s * rank:s * rank + self.rank] = self.A[:, s * self.rank:(s + 1) * self.rank]
            B[:, :, s * rank:s * rank + self.rank] = self.B[:, :, s * self.rank:(s + 1) * self.rank]
        self.A, self.B, self.rank = A, B, rank

    @torch.no_grad()
    def place(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (A [r, in], scaled B [size, r]) per shard into `slot` (None: the shard is not
        targeted); an empty list clears the slot."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        out = 0
        for s, size in enumerate(self.shard_sizes):
            pair = shards[s] if shards else None
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                self.A[slot, s * self.rank:s * self.rank + r] = a.to(self.dtype)
                self.B[slot, out:out + size, s * self.rank:s * self.rank + r] = b.to(self.dtype)
            out += size

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter product (x: the layer's input [T, in]; y: its output [T, out], written in
        place)."""
        groups = self.step.groups
        if not groups:
            return y
        assert x.dim() == 2, "LoRA rows are the step's flattened tokens"
        for slot, rows in groups:
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ self.A[slot].T) @ self.B[slot].T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.A[slot].T) @ self.B[slot].T)
        return y
