"""The state pool: each linear-attention layer's conv state and recurrent state per request (Gated DeltaNet's,
Qwen3-Next / Qwen3.5), beside the paged KV pool that the hybrid model's full-attention layers use.

A request's state is one slot of fixed size, however long its context: the slot is its request-table row
(ReqToTokenPool), so it is taken when the request is admitted and given back with the row (finish, abort,
retraction), through the same KVManager calls as its KV; the pool has a slot for every row the worker's table
has. A row's slot is zeroed by the step that starts its request's prefill at token 0 (a new request, or a
retracted one computed again), so nothing of a previous tenant survives. The prefix cache is off for these
families (Family.prefix_cache): a cached prefix's K/V without the state at its end cannot resume a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

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
    """conv [layers, slots, conv_dim, conv_kernel - 1] and recurrent [layers, slots, heads, key_dim, value_dim]."""

    def __init__(self, layout: LinearStateLayout, slots: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.layout, self.slots = layout, slots
        self.conv = torch.zeros((layout.num_layers, slots, layout.conv_dim, layout.conv_kernel - 1), dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros((layout.num_layers, slots, layout.num_heads, layout.key_dim, layout.value_dim),
                                     dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def reset(self, slots: torch.Tensor) -> None:
        """Zeroes the state of `slots` in every layer (requests starting at token 0)."""
        self.conv[:, slots] = 0
        self.recurrent[:, slots] = 0


def build_state_pool(layout: LinearStateLayout | None, slots: int, dtype: torch.dtype,
                     device: str | torch.device) -> StatePool | None:
    """The worker's pool (None for a model without linear-attention state), its size logged at start-up."""
    if layout is None:
        return None
    pool = StatePool(layout, slots, dtype, device)
    logger.info("linear-attention state pool: %d request slots x %.2f MiB (%d layers: conv + recurrent) = %.1f MiB",
                slots, layout.bytes_per_request(dtype) / 2**20, layout.num_layers, pool.nbytes / 2**20)
    return pool
