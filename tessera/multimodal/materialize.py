"""Deferred images, the worker's half: raw pixels -> features, just before they are encoded, by the HF
processor the frontend would have used (multimodal/deferred.py is the frontend's half and the contract).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tessera.messages.items import MultimodalDataItem
from tessera.multimodal.hashing import kwargs_json
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.platform.device import is_host

__all__ = ["DeferredMaterializer", "materializer_for"]


class DeferredMaterializer:
    """Worker side: deferred items -> ordinary items with features, just before they are encoded.

    `make_processor(image_config)` builds the frontend's processor class for that mm_process_config["image"];
    one instance per distinct config is kept. Items without a deferred payload pass through untouched.
    """

    def __init__(self, make_processor: Callable[[dict[str, Any]], BaseMultimodalProcessor],
                 device: torch.device | None = None) -> None:
        self._make = make_processor
        self._device = str(device) if device is not None and not is_host(device) else None
        self._processors: dict[str, BaseMultimodalProcessor] = {}
        self._lock = threading.Lock()
        self.materialized = 0  # images preprocessed here

    def _processor(self, config: dict[str, Any]) -> BaseMultimodalProcessor:
        key = kwargs_json(config)
        with self._lock:
            proc = self._processors.get(key)
            if proc is None:
                proc = self._processors[key] = self._make(config)
                proc.image_device = self._device
            return proc

    def __call__(self, items: Sequence[MultimodalDataItem]) -> list[MultimodalDataItem]:
        out = list(items)
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if item.deferred is not None:
                groups.setdefault(kwargs_json(item.deferred.config), []).append(i)
        for indices in groups.values():
            first = items[indices[0]].deferred
            assert first is not None
            features = self._processor(first.config).materialize_images(
                [items[i].deferred.pixels for i in indices])  # type: ignore[union-attr]
            for i, f in zip(indices, features, strict=True):
                _check_plan(items[i], f)
                # A new item: the scheduler's copy keeps its small payload (it may be encoded again after a
                # retraction or an encoder-cache eviction).
                out[i] = dataclasses.replace(items[i], feature=f.feature, deferred=None)
            self.materialized += len(indices)
        return out


def _check_plan(item: MultimodalDataItem, f: ItemFeatures) -> None:
    same = f.num_tokens == item.num_tokens and all(
        k in f.model_specific_data and torch.equal(v.cpu(), f.model_specific_data[k].cpu())
        for k, v in item.model_specific_data.items())
    if not same:
        planned = {k: v.tolist() for k, v in item.model_specific_data.items()}
        got = {k: v.tolist() for k, v in f.model_specific_data.items()}
        raise ValueError(f"deferred image: the processor made {f.num_tokens} tokens {got}, the frontend planned "
                         f"{item.num_tokens} {planned}")


def materializer_for(processor_path: str, hf_config: Any, processor_class: type | None,
                     device: torch.device | None) -> DeferredMaterializer | None:
    """The materialiser of a served model (None for families without a media processor). The HF processor
    is loaded from `processor_path` on the first deferred image, so text-only traffic never pays for it."""
    if processor_class is None:
        return None
    loaded: list[Any] = []

    def make(image_config: dict[str, Any]) -> BaseMultimodalProcessor:
        if not loaded:
            from transformers import AutoProcessor

            loaded.append(AutoProcessor.from_pretrained(processor_path))
        return processor_class(loaded[0], hf_config, {"image": image_config} if image_config else {})

    return DeferredMaterializer(make, device)
