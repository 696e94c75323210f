"""The embedding merge shared by every multimodal model, whatever its language model.

Encoders produce one embedding per item; `item_embeddings` handles the items that arrive with a
precomputed embedding and checks every row count against the item's placeholders; `merge_mm_embeddings`
scatters the step's embedding rows into the token embeddings at their flat rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.messages.items import MultimodalDataItem


class EmbeddingCountError(ValueError):
    """An encoder's output does not cover exactly the item's placeholder tokens."""


def item_embeddings(items: list[MultimodalDataItem], encode: Callable[[list[int]], list[torch.Tensor]],
                    like: torch.Tensor) -> list[torch.Tensor]:
    """One embedding [num_tokens, hidden] per item, in order, in `like`'s dtype and device.

    Items with a precomputed_embedding pass through; the indices of the others go to `encode` in ONE call,
    which returns their embeddings in that order.
    """
    out: list[torch.Tensor | None] = [None] * len(items)
    todo = [i for i, item in enumerate(items) if item.precomputed_embedding is None]
    for i, item in enumerate(items):
        if item.precomputed_embedding is not None:
            out[i] = item.precomputed_embedding.to(device=like.device, dtype=like.dtype)
    if todo:
        for i, emb in zip(todo, encode(todo)):
            out[i] = emb.to(like.dtype)
    checked = []
    for i, (item, emb) in enumerate(zip(items, out)):
        assert emb is not None
        if item.offsets and emb.shape[0] != item.num_tokens:
            raise EmbeddingCountError(f"{item.modality.value} item {i}: embedding has {emb.shape[0]} rows but "
                                      f"its offsets cover {item.num_tokens} tokens")
        checked.append(emb)
    return checked


def merge_mm_embeddings(input_embeds: torch.Tensor, rows: torch.Tensor | None,
                        mm_embeds: torch.Tensor | None) -> torch.Tensor:
    """input_embeds [T, H] with mm_embeds [n, H] written at the flat rows `rows` [n] (in place)."""
    if rows is None and mm_embeds is None:
        return input_embeds
    if rows is None or mm_embeds is None:
        raise ValueError("mm_embed_rows and mm_embeds must be set together")
    if rows.shape[0] != mm_embeds.shape[0]:
        raise EmbeddingCountError(f"mm_embed_rows has {rows.shape[0]} placeholder rows but mm_embeds has "
                                  f"{mm_embeds.shape[0]} embedding rows")
    if mm_embeds.shape[-1] != input_embeds.shape[-1]:
        raise EmbeddingCountError(f"media embeddings are {mm_embeds.shape[-1]} wide, the language model takes "
                                  f"{input_embeds.shape[-1]}")
    return input_embeds.index_copy_(0, rows, mm_embeds.to(input_embeds.dtype))
