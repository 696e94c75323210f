"""Splitting a single-modality processor's inputs into per-item features, by input format.

The HF processor's output and a caller's processor_output dict carry the same fields, so one hook splits both;
precomputed_embedding dicts have their own. The helpers read the per-item tensors callers may send either as a
list or as one batched array.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures, as_tensor
from tessera.multimodal.processors.loaded import InputFormat, LoadedMultimodalData

__all__ = ["SplitByInputFormat", "as_tensors", "embedding_chunks"]


class SplitByInputFormat(abc.ABC):
    """Mixin for a BaseMultimodalProcessor of one modality: `split_hf_output` and `split_preprocessed` from the
    two hooks below."""

    supported_modalities: ClassVar[frozenset[Modality]]

    @abc.abstractmethod
    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """Per-item features of HF-processor fields; `what` names the source in errors, num_items (when known)
        is the number of items the data must hold."""

    @abc.abstractmethod
    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """Per-item features of a precomputed_embedding dict."""

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        (modality,) = self.supported_modalities
        num_items = loaded.raw_counts()[modality]
        if not num_items:
            return []
        items = self.split_fields(hf_output, "the HF processor's output", num_items)
        assert len(items) == num_items, f"the HF processor returned {len(items)} items for {num_items}"
        return items

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        assert modality in self.supported_modalities
        if input_format is InputFormat.PROCESSOR_OUTPUT:
            return self.split_fields(data, input_format.value, None)
        return self.split_embeddings(data)


def as_tensors(value: Any, name: str, batch_ndim: int | None = None) -> list[torch.Tensor]:
    """A caller's per-item arrays: a list/tuple of them, or one array that is a single item, or, when it has
    `batch_ndim` dimensions, a batch of items along its first dimension."""
    if isinstance(value, (list, tuple)):
        return [as_tensor(v, name) for v in value]
    t = as_tensor(value, name)
    return list(t) if t.ndim == batch_ndim else [t]


def embedding_chunks(data: Mapping[str, Any], tokens: Sequence[int], embed_dim: int, counted_by: str,
                     content: str) -> list[torch.Tensor]:
    """precomputed_embedding image data's `feature` as one floating-point [tokens[i], embed_dim] chunk per image:
    a list of chunks, or all images' rows in one tensor (split here). `counted_by` names the field that set
    `tokens`, `content` what the rows are (both for the errors)."""
    if data.get("feature") is None:
        raise ValueError(f"precomputed_embedding image data needs 'feature' ({content})")
    feature = data["feature"]
    if isinstance(feature, (list, tuple)):
        chunks = [as_tensor(f, "feature") for f in feature]
    else:
        emb = as_tensor(feature, "feature")
        if emb.ndim != 2 or emb.shape[0] != sum(tokens):
            raise ValueError(f"precomputed image feature has shape {tuple(emb.shape)}; the {counted_by} given need "
                             f"[{sum(tokens)}, hidden]")
        chunks = [c.clone() for c in emb.split(list(tokens))]
    if len(chunks) != len(tokens) or any(c.ndim != 2 or c.shape[0] != n or c.shape[1] != embed_dim
                                         or not c.is_floating_point() for c, n in zip(chunks, tokens)):
        raise ValueError(f"precomputed image features have shapes {[tuple(c.shape) for c in chunks]}; the "
                         f"{counted_by} given need {list(tokens)} floating-point rows of {embed_dim} values")
    return chunks
