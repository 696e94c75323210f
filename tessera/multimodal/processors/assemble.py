"""Turning per-item features into placeholder-expanded input_ids and MultimodalDataItems.

Contract: placeholders of one modality are matched to that modality's items in order (the
i-th image item owns the i-th run of image placeholder tokens, counted by num_tokens, so
adjacent items of one modality split correctly). Any mismatch raises ValueError naming the
modality and the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessera.messages.items import DeferredImage, Modality, MultimodalDataItem, MultimodalInputs
from tessera.multimodal.special_tokens import (
    MultimodalSpecialTokens,
    check_placeholder_counts,
)

__all__ = ["ItemFeatures", "ProcessorOutput", "expand_placeholders", "build_items", "runs"]


@dataclass
class ItemFeatures:
    """One item's share of the processor output, before offsets and hash are attached."""

    modality: Modality
    num_tokens: int
    feature: torch.Tensor | None = None
    precomputed_embedding: torch.Tensor | None = None
    model_specific_data: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: DeferredImage | None = None  # instead of `feature`: preprocessing left to the encoder's worker


@dataclass
class ProcessorOutput:
    """What the frontend hands on: prompt ids with placeholders expanded, and the items."""

    input_ids: list[int]
    mm_inputs: MultimodalInputs


def _placeholder_id(tokens: MultimodalSpecialTokens, modality: Modality) -> int:
    token_id = tokens.token_id(modality)
    if token_id is None:
        raise ValueError(f"this model has no {modality.value} placeholder token")
    return token_id


def expand_placeholders(input_ids: list[int], features: Sequence[ItemFeatures],
                        tokens: MultimodalSpecialTokens) -> list[int]:
    """`input_ids` with each single placeholder replaced by its item's num_tokens copies;
    unchanged for modalities that are already expanded. Mismatches raise ValueError."""
    per_modality: dict[Modality, list[ItemFeatures]] = {}
    for f in features:
        per_modality.setdefault(f.modality, []).append(f)
    found = tokens.count_ids(input_ids)
    if per_modality and not any(found.get(m, 0) for m in per_modality):
        # Same wording as the prompt check: no placeholders at all.
        check_placeholder_counts(found, {m: len(fs) for m, fs in per_modality.items()}, tokens, what="input_ids")
    for m, n in found.items():
        if n and m not in per_modality:
            raise ValueError(f"input_ids have {n} {m.value} placeholder tokens but no {m.value} items were given")
    expand: dict[int, list[int]] = {}
    for modality, feats in per_modality.items():
        n_found, needed = found.get(modality, 0), sum(f.num_tokens for f in feats)
        if n_found == needed:
            continue
        if n_found != len(feats):
            raise ValueError(
                f"input_ids have {n_found} {modality.value} placeholder tokens; expected {len(feats)} "
                f"(one per {modality.value} item) or {needed} (already expanded)"
            )
        expand[_placeholder_id(tokens, modality)] = [f.num_tokens for f in feats]
    if not expand:
        return list(input_ids)
    out: list[int] = []
    cursors = {token_id: iter(counts) for token_id, counts in expand.items()}
    for t in input_ids:
        out.extend([t] * next(cursors[t]) if t in cursors else [t])
    return out


def build_items(input_ids: list[int], features: Sequence[ItemFeatures], hashes: Sequence[int],
                tokens: MultimodalSpecialTokens) -> list[MultimodalDataItem]:
    """Items with offsets over already-expanded `input_ids`, sorted by first offset."""
    wanted = {_placeholder_id(tokens, f.modality) for f in features}
    positions: dict[int, list[int]] = {t: [] for t in wanted}
    for i, t in enumerate(input_ids):
        if t in wanted:
            positions[t].append(i)
    taken = {t: 0 for t in wanted}
    items = []
    for f, h in zip(features, hashes, strict=True):
        token_id = _placeholder_id(tokens, f.modality)
        start = taken[token_id]
        mine = positions[token_id][start: start + f.num_tokens]
        if len(mine) != f.num_tokens or f.num_tokens == 0:
            raise ValueError(f"input_ids lack placeholder tokens for a {f.modality.value} item")
        taken[token_id] = start + f.num_tokens
        items.append(MultimodalDataItem(
            modality=f.modality, hash=h, offsets=runs(mine), feature=f.feature,
            precomputed_embedding=f.precomputed_embedding, model_specific_data=f.model_specific_data,
            deferred=f.deferred,
        ))
    for token_id, n in taken.items():
        if n != len(positions[token_id]):
            raise ValueError(f"input_ids have {len(positions[token_id])} placeholder tokens (id {token_id}) "
                             f"but the items need {n}")
    items.sort(key=lambda item: item.offsets[0][0])
    return items


def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive integers in sorted `positions`."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A caller-supplied array as a CPU tensor, or ValueError naming the field."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a tensor or array, got {type(value).__name__}") from e
