"""Which data-parallel replica serves a request (`--dp-size N`, `--load-balance-method`).

- round_robin: replicas in turn;
- shortest_queue: the replica with the fewest requests in flight (sent, not yet finished);
- cache_aware: the replica most likely to hold the request's KV already: the one that last served the
  longest of its prompt-prefix blocks (cache keys, so images count by content) or, failing that, one of its
  images; unless that replica is much busier than the least busy one, then shortest_queue decides.

The dispatcher lives in the frontend and sees only what it sent: its picture of each replica's cache is
approximate (an evicted prefix still attracts requests), which costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

METHODS = ("round_robin", "shortest_queue", "cache_aware")
BLOCK = 32  # prompt tokens per prefix block
MAX_BLOCKS = 64  # blocks looked at per request (the first 2048 tokens)
MEMORY = 8192  # remembered keys per replica (LRU)
IMBALANCE = 4  # requests in flight over the least busy replica before cache affinity yields to load


class Dispatcher:
    def __init__(self, num_replicas: int, method: str = "round_robin"):
        if method not in METHODS:
            raise ValueError(f"load_balance_method: expected one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self.in_flight = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._turn = itertools.cycle(range(num_replicas))
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._owner: dict[str, int] = {}

    def _live(self) -> list[int]:
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RuntimeError("no data-parallel replica is alive")
        return live

    def choose(self, rid: str, cache_key: Sequence[int], item_hashes: Sequence[int]) -> int:
        """Picks the replica for request `rid` (cache_key: its prompt ids with media replaced by their pad
        values) and counts it in flight there."""
        live = self._live()
        if self.method == "round_robin":
            replica = next(i for i in self._turn if self.alive[i])
        else:
            least = min(live, key=lambda i: (self.in_flight[i], i))
            replica = least
            if self.method == "cache_aware":
                best = self._best_cached(live, self._keys(cache_key), item_hashes)
                if best is not None and self.in_flight[best] <= self.in_flight[least] + IMBALANCE:
                    replica = best
        if self.method == "cache_aware":
            self._remember(replica, self._keys(cache_key) + list(item_hashes))
        self.in_flight[replica] += 1
        self._owner[rid] = replica
        return replica

    def owner(self, rid: str) -> int | None:
        return self._owner.get(rid)

    def finished(self, rid: str) -> None:
        replica = self._owner.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def requests_on(self, replica: int) -> list[str]:
        return [rid for rid, r in self._owner.items() if r == replica]

    @staticmethod
    def _keys(cache_key: Sequence[int]) -> list[int]:
        """Hashes of the prompt's whole prefix blocks, shortest first."""
        blocks = min(len(cache_key) // BLOCK, MAX_BLOCKS)
        return [hash(tuple(cache_key[: (b + 1) * BLOCK])) for b in range(blocks)]

    def _best_cached(self, live: list[int], prefix_keys: list[int], item_hashes: Sequence[int]) -> int | None:
        best, best_score = None, (0, 0)
        for i in live:
            seen = self._seen[i]
            blocks = next((n for n in range(len(prefix_keys), 0, -1) if prefix_keys[n - 1] in seen), 0)
            items = sum(h in seen for h in item_hashes)
            score = (blocks, items)
            if score > best_score:
                best, best_score = i, score
        return best

    def _remember(self, replica: int, keys: list[int]) -> None:
        seen = self._seen[replica]
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > MEMORY:
            seen.popitem(last=False)
