"""Encoder-output cache: vision/audio embeddings keyed by the item's content hash.

An LRU bounded in bytes; a repeated image skips the encoder. Entries larger than the whole
budget are never stored (they would only evict everything else).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tessera.platform.device import to_host


class EncoderCache:
    def __init__(self, capacity_bytes: int, keep_on_device: bool = False):
        self.capacity_bytes = capacity_bytes
        # Features normally go to the host to spare device memory (--keep-mm-feature-on-device keeps them
        # where the encoder left them, saving two copies per hit); host copies of CUDA tensors are pinned, so
        # the copy back to the device on a hit is asynchronous.
        self.keep_on_device = keep_on_device
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: int) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: int, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.capacity_bytes or key in self._entries:
            return
        if not self.keep_on_device:
            value = to_host(value)
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.used_bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

