"""The multimodal data model: what a processor hands to the scheduler and the model worker.

Contract: the processor expands each item's placeholder into `num_tokens` copies of the
model's placeholder token id in `input_ids`; `offsets` are the [start, end) token ranges of
those copies. `pad_value` replaces the placeholder ids in the prefix-cache key only, so two
different items never share KV and the same item always can. It is derived from `hash`
and is >= PAD_VALUE_BASE, above every real vocabulary id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

# Pad values live above any realistic vocabulary (2**31 ids) and below 2**63.
PAD_VALUE_BASE = 1 << 31
PAD_VALUE_SPAN = (1 << 62) - 1


class Modality(str, enum.Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


@dataclass
class DeferredImage:
    """An image whose expensive preprocessing (resize, rescale, normalise, patchify) is left to the worker
    that runs the vision encoder: the decoded pixels, and the processing config the frontend would have used.

    The frontend already counted the item's placeholder tokens and filled its model_specific_data from the
    image size (the same rules as the HF image processor); the owner runs the same processor on `pixels`
    just before encoding (see tessera.multimodal.deferred), so the features equal the eager path's.
    """

    pixels: torch.Tensor  # uint8 [C, H, W], RGB, as decoded (before any resize)
    config: dict[str, Any]  # mm_process_config["image"] of the frontend's processor (JSON-able)


@dataclass
class MultimodalDataItem:
    """One image, video or audio clip of a request."""

    modality: Modality
    hash: int  # 64-bit digest of content + feature-shaping preprocessing kwargs
    offsets: list[tuple[int, int]]  # [start, end) ranges of its placeholder tokens in input_ids
    # Exactly one of `feature` (processor output: pixel values / audio features) and
    # `precomputed_embedding` (encoder output, [num_tokens, hidden]) is set.
    feature: torch.Tensor | None = None
    precomputed_embedding: torch.Tensor | None = None
    # Model-specific tensors, e.g. {"image_grid_thw": tensor([[t, h, w]])}, {"feature_attention_mask": ...}.
    model_specific_data: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set instead of `feature` while an image's preprocessing is deferred to the encoder's worker; the hash is
    # that of the eager item (same content, same kwargs), so both paths share prefix and encoder cache entries.
    deferred: DeferredImage | None = None
    # The LoRA adapter of the request (layers/lora): an adapter on the vision tower changes the embedding, so the
    # frontend folds it into `hash` too (the encoder and prefix caches never mix adapters). None: the base model.
    lora_name: str | None = None

    @property
    def pad_value(self) -> int:
        return PAD_VALUE_BASE + (self.hash % PAD_VALUE_SPAN)

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.offsets)

    @property
    def transport_bytes(self) -> int:
        """Bytes of tensor payload this item carries from the frontend to the scheduler."""
        tensors = [self.feature, self.precomputed_embedding, *self.model_specific_data.values()]
        if self.deferred is not None:
            tensors.append(self.deferred.pixels)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class MultimodalInputs:
    """All media of one request, in prompt order."""

    items: list[MultimodalDataItem]
    # Qwen2-VL M-RoPE: positions [3, prompt_len] for the prompt and the delta that continues
    # decode positions (next position = seq_len + mrope_position_delta).
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0

    def spans(self) -> list[tuple[int, int]]:
        """Every placeholder range of every item, in prompt order."""
        return sorted(r for item in self.items for r in item.offsets)

    def cross_media_salt(self) -> str | None:
        """Items with no placeholder tokens (media a decoder cross-attends to: Mllama's images) change every
        token's K/V, the first included: the prefix-cache key's first token is salted with their hashes (None
        when there are none)."""
        hashes = [f"{it.hash:x}" for it in self.items if not it.offsets]
        return "media:" + ",".join(hashes) if hashes else None

    def pad_input_ids(self, input_ids: list[int]) -> list[int]:
        """The prefix-cache key: placeholder ids replaced by each item's pad value."""
        key = list(input_ids)
        for item in self.items:
            pad = item.pad_value
            for s, e in item.offsets:
                key[s:e] = [pad] * (e - s)
        return key
