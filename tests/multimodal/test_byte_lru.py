"""ByteLRU: the one byte-bounded LRU of the media caches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tessera.cache.encoder_cache import EncoderCache
from tessera.multimodal.byte_lru import ByteLRU
from tessera.multimodal.processors.preprocess_cache import PreprocessCache


def test_evicts_least_recent_to_fit_and_refuses_oversize() -> None:
    lru = ByteLRU(10, size_of=len)
    lru.put("a", "xxxx")
    lru.put("b", "yyyy")
    assert lru.get("a") == "xxxx"  # b is now the least recent
    lru.put("c", "zzzz")
    assert "b" not in lru and "a" in lru and "c" in lru and lru.used_bytes == 8
    lru.put("a", "other")  # a present key keeps its first value
    assert lru.get("a") == "xxxx" and lru.used_bytes == 8
    lru.put("big", "w" * 11)  # over the whole budget: not stored, nothing evicted
    assert "big" not in lru and len(lru) == 2
    assert lru.get("b") is None
    assert lru.snapshot() == (2, 1, 8, 2)
    lru.clear()
    assert len(lru) == 0 and lru.used_bytes == 0


def test_store_is_what_is_kept_and_zero_capacity_stores_nothing() -> None:
    lru = ByteLRU(100, size_of=len, store=str.upper)
    lru.put(1, "ab")
    assert lru.get(1) == "AB"
    off = ByteLRU(0, size_of=len, store=str.upper)
    off.put(1, "ab")
    assert off.get(1) is None and (off.hits, off.misses) == (0, 1)


def test_concurrent_puts_stay_within_budget() -> None:
    lru = ByteLRU(50, size_of=len)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: (lru.put(i % 20, "x" * (i % 7 + 1)), lru.get(i % 13)), range(2000)))
    assert lru.used_bytes == sum(len(lru.get(k)) for k in range(20) if k in lru) <= 50


@pytest.mark.parametrize("cache", [EncoderCache(1 << 10), PreprocessCache(1 << 10)], ids=["encoder", "preprocess"])
def test_both_media_caches_are_this_lru(cache) -> None:
    assert isinstance(cache, ByteLRU)
