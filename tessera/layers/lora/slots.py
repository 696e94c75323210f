"""The LoRA stacks of one linear layer and the batched product that adds them to its output.

Every adapter a step may use sits in a slot (the pool: `--max-loras-per-batch` slots, written by the worker
when the scheduler assigns an adapter to one); a layer an adapter does not target holds zeros in its slot. A
merged linear (QKV, gate-up) holds its shards' A matrices stacked along the rank, [slots, shards * rank, in],
and their B matrices transposed and block-diagonal, [slots, shards * rank, out] (shard s's rank rows feed only
its output columns), so each row is one shrink and one expand product whatever the shards, and every slot's B
together is one [slots * shards * rank, out] matrix. B carries the adapter's scaling (alpha / r), folded in
when it is placed.

Two ways to run a step's rows (both exact: a row only ever sums its own adapter's terms):
- grouped (Punica / S-LoRA's segments): per slot, one pair of products over its rows, a slice where the
  group's requests are adjacent, gathered rows otherwise. A prefill's rows are one or a few long groups;
- stacked, for a few rows over several adapters (a decode batch): one shrink over every used slot's A at
  once, the other slots' columns zeroed by the step's row mask, one expand over every used slot's B. Two
  products per layer whatever the number of adapters, where the grouped way pays 4 small operations per
  adapter (each a Python call at decode sizes).
A decode CUDA graph (worker/cuda_graph.py) runs its rows from a device tensor of row slots alone, over every
slot (`LoraStep.decode_graph`): the kernels, or the stacked product over all slots. Rows of requests without an
adapter get nothing added. A CPU decode step in float32 skips both: the decode
stack's C driver (layers/decode_stack.py) reads these stacks and adds each row's own products there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


# Rows up to which a step with several adapters runs stacked (see the module docstring): its products compute
# every used slot for every row, which for a few rows costs less than the grouped way's calls (at demo-vl's
# sizes 35-43 us a layer for 4 adapters; docs/benchmarks.md, "Multi-LoRA"), and for many rows more.
STACKED_MAX_ROWS = 64


@dataclass
class LoraStep:
    """The current forward's rows per slot, set by the worker around the model's forward and read by every
    layer's LoraSlots (a scoped hand-off: None outside a step, and during a step without adapter rows)."""

    groups: list[tuple[int, slice | torch.Tensor]] | None = None
    dtype: torch.dtype = torch.float32  # the activations' (the masks are multiplied into them)
    # Per token row: its slot (-1: base model); what the Triton kernel takes instead of groups (CUDA).
    row_slots: torch.Tensor | None = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, first row, end row), in order
    num_used: int = 0  # slots 0..num_used-1 cover every slot the step uses
    kernels: bool = False  # the products run as the Triton kernels (triton_lora.py; the manager decides)
    graph: bool = False  # a decode graph's step: rows by row_slots alone, every slot (decode_graph)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # stacked-way row masks by rank width

    def stacked(self) -> bool:
        return self.groups is not None and len(self.groups) > 1 and self.row_slots is not None \
            and self.row_slots.shape[0] <= STACKED_MAX_ROWS

    def mask(self, width: int) -> torch.Tensor:
        """[rows, num_used * width]: 1 where the column belongs to the row's slot (each slot `width` columns)."""
        m = self._masks.get(width)
        if m is None:
            assert self.row_slots is not None
            one_hot = self.row_slots[:, None] == torch.arange(self.num_used, device=self.row_slots.device)
            m = one_hot[:, :, None].expand(-1, -1, width).reshape(self.row_slots.shape[0], -1).to(self.dtype)
            self._masks[width] = m
        return m

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
            self.groups, self.row_slots = None, None
            return
        self.num_used = 1 + max(slot for slot, _, _ in self.segments)
        row_slots = torch.full((start,), -1, dtype=torch.int64)
        for slot, lo, hi in self.segments:
            row_slots[lo:hi] = slot
        self.row_slots = row_slots.to(device, non_blocking=True)
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

    @contextmanager
    def decode_graph(self, row_slots: torch.Tensor, num_slots: int) -> Iterator[None]:
        """Within: every layer adds its rows' adapters by `row_slots` (a static device buffer, -1 for the base
        model) over all `num_slots` slots, reading no host value of the step, which a captured graph could not
        follow. The masks are made anew within, so a capture records them and a replay recomputes them."""
        saved = (self.groups, self.row_slots, self.num_used, self._masks)
        self.graph, self.row_slots, self.num_used, self._masks = True, row_slots, num_slots, {}
        try:
            yield
        finally:
            self.graph = False
            self.groups, self.row_slots, self.num_used, self._masks = saved

    def clear(self) -> None:
        self.groups, self.segments, self.row_slots, self.num_used = None, [], None, 0
        self._masks = {}


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
        self.Bt = torch.zeros(num_slots, 0, sum(shard_sizes), dtype=dtype, device=device)

    def ensure_rank(self, rank: int) -> None:
        if rank <= self.rank:
            return
        n = len(self.shard_sizes)
        A = torch.zeros(self.num_slots, n * rank, self.in_features, dtype=self.dtype, device=self.device)
        Bt = torch.zeros(self.num_slots, n * rank, sum(self.shard_sizes), dtype=self.dtype, device=self.device)
        for s in range(n):  # keep what the slots hold, each shard's block at its new place
            A[:, s * rank:s * rank + self.rank] = self.A[:, s * self.rank:(s + 1) * self.rank]
            Bt[:, s * rank:s * rank + self.rank] = self.Bt[:, s * self.rank:(s + 1) * self.rank]
        self.A, self.Bt, self.rank = A, Bt, rank

    @torch.no_grad()
    def place(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (A [r, in], scaled B [size, r]) per shard into `slot` (None: the shard is not
        targeted); an empty list clears the slot."""
        self.A[slot].zero_()
        self.Bt[slot].zero_()
        out = 0
        for s, size in enumerate(self.shard_sizes):
            pair = shards[s] if shards else None
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                self.A[slot, s * self.rank:s * self.rank + r] = a.to(self.dtype)
                self.Bt[slot, s * self.rank:s * self.rank + r, out:out + size] = b.T.to(self.dtype)
            out += size

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter product (x: the layer's input [T, in]; y: its output [T, out], written in
        place)."""
        step = self.step
        groups = step.groups
        if not (groups or step.graph):
            return y
        assert x.dim() == 2, "LoRA rows are the step's flattened tokens"
        if step.kernels and step.row_slots is not None:
            from tessera.layers.lora import triton_lora

            return triton_lora.lora_expand(y, triton_lora.lora_shrink(x, self.A, step.row_slots), self.Bt,
                                           step.row_slots)
        if step.graph or step.stacked():
            used, width = step.num_used, self.A.shape[1]
            xa = x @ self.A[:used].reshape(used * width, -1).T  # [rows, used * width]: every used slot's shrink
            return y.addmm_(xa.mul_(step.mask(width)), self.Bt[:used].reshape(used * width, -1))
        for slot, rows in groups:  # type: ignore[union-attr]
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ self.A[slot].T, self.Bt[slot])
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.A[slot].T) @ self.Bt[slot])
        return y


@dataclass
class EncoderAdapter:
    """The adapter of the encoder call in progress (None: the base model); set under the worker's encoder lock,
    around the call for one adapter's items (worker/lora_step.py encode_by_adapter)."""

    name: str | None = None


class EncoderLora:
    """An encoder linear's adapters (the vision tower's, the projector's): per adapter (A [r, in], B^T [r, out]),
    applied to every row of the call, whatever its shape, when that adapter's items are encoded. Encoder calls
    group items by adapter (an item's rows are many patches, not one token), so no slots are needed."""

    def __init__(self, current: EncoderAdapter):
        self.current = current
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pair = self.adapters.get(self.current.name) if self.current.name is not None else None
        if pair is None:
            return y
        a, bt = pair
        y.view(-1, y.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]) @ a.T.to(x.dtype), bt.to(x.dtype))
        return y


def _add_encoder_lora(module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
    return module.lora(args[0], y)


def attach_encoder_lora(module: nn.Module, current: EncoderAdapter) -> EncoderLora:
    """The EncoderLora of an encoder linear, made on first use. Our Linear calls its `lora` itself; transformers'
    towers keep torch's nn.Linear (their parameter names and code stay transformers'), where a forward hook adds
    it to the output."""
    lora = getattr(module, "lora", None)
    if lora is None:
        lora = EncoderLora(current)
        if not hasattr(module, "lora"):  # torch's nn.Linear: no `lora` of its own
            module.register_forward_hook(_add_encoder_lora)
        module.lora = lora
    assert isinstance(lora, EncoderLora)
    return lora
