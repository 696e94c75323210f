"""Preprocessing cache: an item's processed features (pixel rows + grid), keyed by its hash.

A repeated image or video skips the HF image/video processor (decode-independent resize,
normalise, patchify), not only the vision encoder. The key is the item hash, which covers the
content and the feature-shaping kwargs (`BaseMultimodalProcessor.feature_kwargs`), so a
different `mm_process_config` never reuses another configuration's features.

Contracts:
- A ByteLRU (tessera/multimodal/byte_lru.py) over feature + model_specific_data tensor bytes.
- Every lookup counts: `hits + misses` is the number of raw items looked up, and `misses` is
  the number that went through the HF processor (also when the cache is disabled).
- Thread-safe: the frontend runs the processor on a worker pool. The LRU's lock guards the map
  and the counters only; preprocessing itself runs outside it, so two threads that miss the same
  item both compute it (both count a miss) and the second `put` is a no-op.
- Entries are shared, not copied: `get` returns a new ItemFeatures (and a new
  model_specific_data dict) over the cached tensors. Nobody writes into an item's tensors in
  place (the scheduler codec only reads them), which is what makes sharing safe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.multimodal.byte_lru import ByteLRU
from tessera.multimodal.processors.assemble import ItemFeatures

__all__ = ["PreprocessCache", "PreprocessCacheStats"]


@dataclass(frozen=True)
class PreprocessCacheStats:
    hits: int
    misses: int
    used_bytes: int
    num_entries: int
    capacity_bytes: int


def _num_bytes(features: ItemFeatures) -> int:
    tensors = [features.feature, features.precomputed_embedding, *features.model_specific_data.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _shallow_copy(features: ItemFeatures) -> ItemFeatures:
    return dataclasses.replace(features, model_specific_data=dict(features.model_specific_data))


class PreprocessCache(ByteLRU[ItemFeatures]):
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"preprocess cache capacity must be >= 0 bytes, got {capacity_bytes}")
        # Stored as a copy: the caller may add keys to its own model_specific_data later.
        super().__init__(capacity_bytes, _num_bytes, store=_shallow_copy)

    def get(self, key: int) -> ItemFeatures | None:
        """The cached features of item `key` (refreshed as most recent), or None (a miss)."""
        entry = super().get(key)
        return None if entry is None else _shallow_copy(entry)

    def stats(self) -> PreprocessCacheStats:
        return PreprocessCacheStats(*self.snapshot(), self.capacity_bytes)
