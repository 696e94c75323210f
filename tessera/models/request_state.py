"""Per-request state a family keeps in the KV pool beside its tokens' K/V (cross-attention K/V of an encoder output).

A model class declares it as `TesseraModel.request_state` (None for decoder-only families); the engine handles
it without knowing the family:
- admission (scheduler/policy.py) takes `extra_slots(config, items)` pool slots for the request besides its
  tokens (0: the request keeps no state, e.g. a text-only Mllama request), so the pool budget covers them; a
  request that cannot get them waits. They are freed with its other KV (finish, abort, retraction: a retracted
  request is filled again when it is re-admitted);
- the first step that schedules the request carries a RequestStateFill (its media items, its slots): the worker
  takes the items' encoder outputs (encoder cache, else one encoder call per modality for the step's misses),
  concatenates each request's in item order and calls `fill`;
- every step the model reads each request's slots at ForwardBatch.state_slots [B, max extra_slots] (a request's
  first ForwardBatch.state_lens[b] entries; padded with slot 0) and `layout(config, items)` at ForwardBatch.state_layouts.
The state depends on an input the token ids do not show, so the prefix cache either is off for the family
(Family.prefix_cache, Whisper) or keys every token with the items' hashes (MultimodalInputs.cross_media_salt,
Mllama).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.messages.items import MultimodalDataItem
    from tessera.models.config import ModelConfig


class RequestState(ABC):
    """Contract of a family's per-request state (see the module docstring)."""

    @abstractmethod
    def extra_slots(self, config: ModelConfig, items: Sequence[MultimodalDataItem]) -> int:
        """Pool slots a request with media `items` holds besides its tokens' K/V; also the rows of its items'
        encoder outputs together, which fill them."""

    @abstractmethod
    def fill(self, model: torch.nn.Module, encoder_outputs: list[torch.Tensor], slots: list[torch.Tensor],
             pool: TokenToKVPool) -> None:
        """Writes each request's state (from its items' encoder outputs, concatenated [extra_slots, d], on any
        device) at its slots ([extra_slots] int64, on the model's device), for every layer that reads it."""

    def layout(self, config: ModelConfig, items: Sequence[MultimodalDataItem]) -> Any:
        """What the model reads per request besides the slots (ForwardBatch.state_layouts), from its items;
        computed once, when the state is filled. Default: nothing."""
        return None


def padded_slot_table(slots: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each request's state slots as the rows of one [B, most slots] table, shorter rows padded with slot 0."""
    width = max((int(s.shape[0]) for s in slots), default=0)
    if all(s.shape[0] == width for s in slots):
        return torch.stack(slots) if slots else torch.zeros(0, 0, dtype=torch.int64, device=device)
    table = torch.zeros(len(slots), width, dtype=torch.int64, device=device)
    for b, s in enumerate(slots):
        table[b, :s.shape[0]] = s
    return table
