"""Preprocessing cache: an item's processed features (pixel rows + grid), keyed by its hash.

A repeated image or video skips the HF image/video processor (decode-independent resize,
normalise, patchify), not only the vision encoder. The key is the item hash, which covers the
content and the feature-shaping kwargs (`BaseMultimodalProcessor.feature_kwargs`), so a
different `mm_process_config` never reuses another configuration's features.

Contracts:
- An LRU bounded in bytes (feature + model_specific_data tensors). An entry larger than the
  whole budget is never stored; capacity 0 stores nothing.
- Every lookup counts: `hits + misses` is the number of raw items looked up, and `misses` is
  the number that went through the HF processor (also when the cache is disabled).
- Thread-safe: the frontend runs the processor on a worker pool. The lock guards the LRU and
  the counters only; preprocessing itself runs outside it, so two threads that miss the same
  item both compute it (both count a miss) and the second `put` is a no-op.
- Entries are shared, not copied: `get` returns a new ItemFeatures (and a new
  model_specific_data dict) over the cached tensors. Nobody writes into an item's tensors in
  place (the scheduler codec only reads them), which is what makes sharing safe.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

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


class PreprocessCache:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"preprocess cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, tuple[ItemFeatures, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._used_bytes = 0
        self._hits = 0
        self._misses = 0

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def get(self, key: int) -> ItemFeatures | None:
        """The cached features of item `key` (refreshed as most recent), or None (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
        return _shallow_copy(entry[0])

    def put(self, key: int, features: ItemFeatures) -> None:
        """Store `features` under `key`, evicting least recently used entries to fit."""
        size = _num_bytes(features)
        if size > self.capacity_bytes:
            return
        stored = _shallow_copy(features)  # the caller may add keys to its own dict later
        with self._lock:
            if key in self._entries:
                return
            while self._used_bytes + size > self.capacity_bytes:
                _, (_, old_size) = self._entries.popitem(last=False)
                self._used_bytes -= old_size
            self._entries[key] = (stored, size)
            self._used_bytes += size

    def stats(self) -> PreprocessCacheStats:
        with self._lock:
            return PreprocessCacheStats(self._hits, self._misses, self._used_bytes, len(self._entries),
                                        self.capacity_bytes)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries
