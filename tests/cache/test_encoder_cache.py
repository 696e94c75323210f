"""EncoderCache: LRU in bytes, hit/miss counters, and where entries live (--keep-mm-feature-on-device)."""

from __future__ import annotations

import pytest
import torch

from tessera.cache.encoder_cache import EncoderCache


class DeviceTensor:
    """Stands in for an accelerator tensor on a CPU-only machine: the cache only uses numel,
    element_size and to(); `to` records its targets and returns a copy on that device."""

    def __init__(self, data: torch.Tensor, device: str) -> None:
        self.data, self.device = data, torch.device(device)
        self.moves: list[torch.device] = []

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return self.data.element_size()

    def to(self, device: str | torch.device) -> DeviceTensor:
        self.moves.append(torch.device(device))
        return DeviceTensor(self.data.clone(), str(device))


def test_default_moves_entries_to_the_host():
    cache = EncoderCache(capacity_bytes=1 << 20, keep_on_device=False)
    emb = DeviceTensor(torch.randn(4, 8), "cuda:0")
    cache.put(11, emb)
    stored = cache.get(11)
    assert emb.moves == [torch.device("cpu")]
    assert stored is not emb and stored.device == torch.device("cpu")
    assert torch.equal(stored.data, emb.data)


def test_keep_on_device_stores_the_produced_tensor():
    cache = EncoderCache(capacity_bytes=1 << 20, keep_on_device=True)
    emb = DeviceTensor(torch.randn(4, 8), "cuda:0")
    cache.put(11, emb)
    stored = cache.get(11)
    assert emb.moves == []  # no copy at all
    assert stored is emb and stored.device == torch.device("cuda:0")


@pytest.mark.parametrize("keep", [False, True])
def test_cpu_tensors_stay_put_either_way(keep):
    cache = EncoderCache(capacity_bytes=1 << 20, keep_on_device=keep)
    emb = torch.randn(4, 8)
    cache.put(3, emb)
    stored = cache.get(3)
    assert stored.device.type == "cpu" and torch.equal(stored, emb)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep", [False, True])
def test_real_device(keep):
    cache = EncoderCache(capacity_bytes=1 << 20, keep_on_device=keep)
    emb = torch.randn(4, 8, device="cuda")
    cache.put(5, emb)
    stored = cache.get(5)
    assert stored.device.type == ("cuda" if keep else "cpu")
    assert torch.equal(stored.cpu(), emb.cpu())
    assert (stored is emb) == keep
    assert keep or stored.is_pinned()  # the copy back on a hit can be asynchronous


def test_lru_bytes_and_counters():
    row = 4 * 8 * 4  # a [4, 8] float32 embedding
    cache = EncoderCache(capacity_bytes=2 * row)
    a, b, c = torch.zeros(4, 8), torch.ones(4, 8), torch.full((4, 8), 2.0)
    cache.put(1, a)
    cache.put(2, b)
    assert cache.get(1) is not None  # 2 becomes the least recently used
    cache.put(3, c)
    assert 2 not in cache and 1 in cache and 3 in cache and cache.used_bytes == 2 * row
    assert cache.get(2) is None
    assert (cache.hits, cache.misses) == (1, 1)
    cache.put(4, torch.zeros(100, 8))  # over the whole budget: not stored, nothing evicted
    assert 4 not in cache and len(cache) == 2
    disabled = EncoderCache(capacity_bytes=0)
    disabled.put(1, a)
    assert disabled.get(1) is None and (disabled.hits, disabled.misses) == (0, 1) and len(disabled) == 0
