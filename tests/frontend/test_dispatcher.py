"""The data-parallel dispatcher: round robin, shortest queue and cache affinity, and dead replicas."""

from __future__ import annotations

import pytest

from tessera.frontend.dispatcher import BLOCK, IMBALANCE, Dispatcher


def test_round_robin_skips_dead_replicas() -> None:
    d = Dispatcher(3, "round_robin")
    assert [d.choose(f"r{i}", [], []) for i in range(4)] == [0, 1, 2, 0]
    d.alive[1] = False
    assert [d.choose(f"s{i}", [], []) for i in range(4)] == [2, 0, 2, 0]
    d.alive = [False, False, False]
    with pytest.raises(RuntimeError, match="no data-parallel replica"):
        d.choose("x", [], [])


def test_shortest_queue_counts_requests_in_flight() -> None:
    d = Dispatcher(2, "shortest_queue")
    assert [d.choose(f"r{i}", [], []) for i in range(3)] == [0, 1, 0]
    d.finished("r0")
    d.finished("r2")
    assert d.in_flight == [0, 1]
    assert d.choose("r3", [], []) == 0
    assert d.owner("r3") == 0 and d.requests_on(1) == ["r1"]


def test_cache_aware_follows_the_longest_prefix_then_images_then_load() -> None:
    d = Dispatcher(2, "cache_aware")
    system = list(range(3 * BLOCK))  # a shared system prompt of three blocks
    assert d.choose("a", system + [1], []) == 0  # nothing cached anywhere: the least busy (ties: lowest)
    assert d.choose("b", [7] * BLOCK, [99]) == 1  # no match: the least busy is now replica 1
    assert d.choose("c", system + [2], []) == 0  # shares 3 blocks with "a": replica 0, though it is busier
    assert d.choose("d", [8] * BLOCK, [99]) == 1  # no prefix match, but replica 1 has seen image 99
    longer = Dispatcher(2, "cache_aware")
    longer.choose("x", list(range(BLOCK)) + [5] * BLOCK, [])  # 1 block in common with "y"'s prompt
    longer.choose("y", [9] * (2 * BLOCK), [])
    longer.finished("x")
    assert longer.choose("z", list(range(BLOCK)) + [6] * BLOCK, []) == 0  # the replica with the longer match
    # Affinity yields to load when the cached replica is much busier.
    for i in range(IMBALANCE + 1):
        d.choose(f"busy{i}", system + [3], [])
    assert d.in_flight[0] > d.in_flight[1] + IMBALANCE
    assert d.choose("e", system + [4], []) == 1


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="load_balance_method"):
        Dispatcher(2, "random")
