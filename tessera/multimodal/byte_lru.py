"""ByteLRU: a least-recently-used map bounded in bytes, the one eviction policy of the media caches
(the encoder-output cache and the preprocessing cache).

Contracts:
- An entry larger than the whole budget is never stored (it would only evict everything else);
  capacity 0 stores nothing. Storing a key that is present is a no-op (the first value stays).
- Every `get` counts: a hit refreshes the entry as most recent, a miss is counted also when the
  cache stores nothing.
- Thread-safe: a lock guards the map and the counters; `store` (the copy a cache keeps) runs
  outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, capacity_bytes: int, size_of: Callable[[V], int],
                 store: Callable[[V], V] | None = None) -> None:
        """size_of: an entry's bytes; store: what is kept for a value put (default: the value itself)."""
        self.capacity_bytes = capacity_bytes
        self._size_of = size_of
        self._store = store
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        """The value stored under `key` (refreshed as most recent), or None (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        """Store `value` under `key`, evicting least recently used entries to fit."""
        size = self._size_of(value)
        if size > self.capacity_bytes or key in self._entries:
            return
        stored = value if self._store is None else self._store(value)
        with self._lock:
            if key in self._entries:  # another thread stored it meanwhile
                return
            while self.used_bytes + size > self.capacity_bytes:
                _, (_, old_size) = self._entries.popitem(last=False)
                self.used_bytes -= old_size
            self._entries[key] = (stored, size)
            self.used_bytes += size

    def snapshot(self) -> tuple[int, int, int, int]:
        """(hits, misses, used_bytes, number of entries), read together."""
        with self._lock:
            return self.hits, self.misses, self.used_bytes, len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries
