"""Per-request state a family keeps in the KV pool beside its tokens' K/V (an encoder-decoder's cross-attention).

A model class declares it as `TesseraModel.request_state` (None for decoder-only families); the engine handles
it without knowing the family:
- admission (scheduler/policy.py) takes `extra_slots(config)` pool slots for the request besides its tokens,
  so the pool budget covers them; a request that cannot get them waits. They are freed with its other KV
  (finish, abort, retraction: a retracted request is filled again when it is re-admitted);
- the first step that schedules the request carries a RequestStateFill (its media item, its slots): the worker
  takes the item's encoder output (encoder cache, else one encoder call for the step's misses) and calls `fill`;
- every step the model reads each request's slots at ForwardBatch.state_slots [B, extra_slots].
The state depends on an input the token ids do not show, so such a family's row also turns the prefix cache
off (Family.prefix_cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.models.config import ModelConfig


class RequestState(ABC):
    """Contract of a family's per-request state (see the module docstring)."""

    @abstractmethod
    def extra_slots(self, config: ModelConfig) -> int:
        """Pool slots each request holds besides its tokens' K/V; also the rows of the encoder output that
        fills them."""

    @abstractmethod
    def fill(self, model: torch.nn.Module, encoder_outputs: list[torch.Tensor], slots: list[torch.Tensor],
             pool: TokenToKVPool) -> None:
        """Writes each request's state (from its encoder output [extra_slots, d], on any device) at its slots
        ([extra_slots] int64, on the model's device), for every layer that reads it."""
