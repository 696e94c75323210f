"""Encoder-output cache: vision/audio embeddings keyed by the item's content hash.

A ByteLRU (tessera/multimodal/byte_lru.py): a repeated image skips the encoder.
"""

from __future__ import annotations

import torch

from tessera.multimodal.byte_lru import ByteLRU
from tessera.platform.device import to_host


def _num_bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


class EncoderCache(ByteLRU[torch.Tensor]):
    def __init__(self, capacity_bytes: int, keep_on_device: bool = False):
        # Features normally go to the host to spare device memory (--keep-mm-feature-on-device keeps them
        # where the encoder left them, saving two copies per hit); host copies of CUDA tensors are pinned, so
        # the copy back to the device on a hit is asynchronous.
        super().__init__(capacity_bytes, _num_bytes, store=None if keep_on_device else to_host)
        self.keep_on_device = keep_on_device
