"""The state pool: each linear-attention layer's conv state and recurrent state (Gated DeltaNet's, Qwen3-Next /
Qwen3.5), beside the paged KV pool that the hybrid model's full-attention layers use.

A request's state is one slot of fixed size, however long its context. Slots [0, rows) are the request-table
rows (ReqToTokenPool): a request's state lives at its row from admission until the row goes back (finish, abort,
retraction), through the same KVManager calls as its KV. A row's slot is zeroed by the step that starts its
request's prefill at token 0, so nothing of a previous tenant survives.

Slots [rows, rows + snapshots) are prefix-cache snapshots (SGLang's MambaRadixCache keeps its mamba states the
same way): a radix node may hold the state after its last token, and a cached prefix is only matched as far as
the deepest node with one (cache/radix_cache.py). The scheduler owns them (SnapshotSlots, host bookkeeping) and
the worker only copies: a request resumed from a snapshot gets it copied into its row before its first step
(`ForwardInput.state_copies`, in journal order, so a slot freed and taken again is read before it is written), a
finished request's row is copied out to a snapshot, and a step saves the state part way through a request's
tokens (`ForwardInput.state_saves`: the end of the prompt's last whole page before its last token, which a
repeated prompt matches; a page its decode completed; scheduler/state_snapshots.py says which). The last slots
are speculative decoding's verify slots (the state after each draft row, to roll back to). The whole pool is
sized from the memory budget at start-up (`split_budget`, `kv_pool.size_pools`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tessera.config import ServerArgs

logger = logging.getLogger("tessera.cache")


@dataclass(frozen=True)
class LinearStateLayout:
    """Sizes of one request's state: per linear-attention layer, the conv window [conv_dim, conv_kernel - 1]
    (in the model's dtype) and the recurrent state [num_heads, key_dim, value_dim] (float32, as the rule runs)."""

    num_layers: int  # linear-attention layers
    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        recurrent = self.num_heads * self.key_dim * self.value_dim * 4
        return self.num_layers * (conv + recurrent)


class StatePool:
    """conv [layers, slots, conv_dim, conv_kernel - 1] and recurrent [layers, slots, heads, key_dim, value_dim];
    slots [0, rows) are request rows, the rest prefix-cache snapshots."""

    def __init__(self, layout: LinearStateLayout, slots: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 rows: int | None = None):
        self.layout, self.slots = layout, slots
        self.rows = slots if rows is None else rows
        self.conv = torch.zeros((layout.num_layers, slots, layout.conv_dim, layout.conv_kernel - 1), dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros((layout.num_layers, slots, layout.num_heads, layout.key_dim, layout.value_dim),
                                     dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def snapshot_range(self) -> tuple[int, int]:
        """(first slot, count) of the slots past the rows: snapshots, then verify slots (verify_slot_count)."""
        return self.rows, self.slots - self.rows

    def reset(self, slots: torch.Tensor) -> None:
        """Zeroes the state of `slots` in every layer (requests starting at token 0)."""
        self.conv[:, slots] = 0
        self.recurrent[:, slots] = 0

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """(source slot, destination slot) copies in every layer, one after another (a later one may read what an
        earlier one wrote)."""
        for src, dst in copies:
            self.conv[:, dst] = self.conv[:, src]
            self.recurrent[:, dst] = self.recurrent[:, src]


class SnapshotSlots:
    """The scheduler's free list of some of the pool's slots, [first, first + count): the snapshots, held by the
    radix cache (a node's) or a request (a save, handed to the cache later); or the verify slots."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert self.first <= slot < self.first + self.count and slot not in self._free, f"bad free of {slot}"
        self._free.append(slot)

    @property
    def num_used(self) -> int:
        return self.count - len(self._free)


# The state pool's share of the memory budget against the KV pool's: state bytes = ratio x KV bytes (SGLang's
# --mamba-full-memory-ratio, and its default).
STATE_TO_KV_MEMORY_RATIO = 0.9


def split_budget(budget_bytes: int, bytes_per_slot: int, rows: int, kv_fixed: bool) -> int:
    """Snapshot slots that the state pool gets besides its `rows` request slots (always there). kv_fixed: the KV
    pool's size was given (--max-total-tokens), so budget_bytes is its size and the snapshots come on top, with
    STATE_TO_KV_MEMORY_RATIO x its bytes; otherwise KV and states (rows first) share budget_bytes in that ratio."""
    ratio = STATE_TO_KV_MEMORY_RATIO
    if kv_fixed:
        return int(budget_bytes * ratio // bytes_per_slot)
    return max(int(budget_bytes * ratio / (1 + ratio) // bytes_per_slot) - rows, 0)


def verify_slot_count(args: ServerArgs) -> int:
    """Slots kept for speculative decoding's verify steps (the state after each draft row), after the snapshots:
    k for each request that may verify at once (no drafts from --speculative-disable-by-batch-size decoding
    requests on). The worker sizes them and the scheduler splits them off with this one count."""
    return args.speculative_num_draft * min(args.max_running_requests, args.speculative_disable_by_batch_size)


def build_state_pool(layout: LinearStateLayout | None, rows: int, snapshots: int, dtype: torch.dtype,
                     device: str | torch.device, verify: int = 0) -> StatePool | None:
    """The worker's pool (None for a model without linear-attention state), its size logged at start-up."""
    if layout is None:
        return None
    pool = StatePool(layout, rows + snapshots + verify, dtype, device, rows=rows)
    per_slot = layout.bytes_per_request(dtype) / 2**20
    logger.info("linear-attention state pool: %d request slots + %d prefix-cache snapshots + %d verify slots = %d "
                "slots x %.2f MiB (%d layers: conv + recurrent) = %.1f MiB", rows, snapshots, verify, pool.slots,
                per_slot, layout.num_layers, pool.nbytes / 2**20)
    return pool
