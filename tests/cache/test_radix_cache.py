import torch

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.radix_cache import RadixCache, TreeNode

PAD = 2**62  # multimodal pad values are this large; keys must keep them exact


def make(page_size: int, num_pages: int = 32, disable: bool = False) -> tuple[PagedTokenAllocator, RadixCache]:
    alloc = PagedTokenAllocator(num_pages * page_size, page_size)
    return alloc, RadixCache(alloc, page_size, disable=disable)


def add(alloc: PagedTokenAllocator, tree: RadixCache, key: list[int]) -> torch.Tensor:
    """Gives `key` fresh slots and caches it like a finished request with no matched prefix."""
    slots = alloc.alloc_extend(0, 0, len(key))
    assert slots is not None
    tree.cache_finished_req(key, slots, 0, tree.root)
    return slots


def test_match_insert_split_page_size_one():
    alloc, tree = make(1)
    a = alloc.alloc_extend(0, 0, 5)
    assert tree.insert([1, 2, 3, 4, 5], a) == 0
    assert tree.total_size() == 5

    m = tree.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == a[:3].tolist()
    assert m.last_node.key == [1, 2, 3]  # the edge was split at the match end
    assert [c.key for c in m.last_node.children.values()] == [[4, 5]]
    assert tree.total_size() == 5  # splitting moves nothing

    b = alloc.alloc_extend(0, 0, 5)
    assert tree.insert([1, 2, 3, 6, 7], b) == 3
    assert tree.total_size() == 7
    m2 = tree.match_prefix([1, 2, 3, 6, 7, 8])
    assert m2.slots.tolist() == a[:3].tolist() + b[3:].tolist()
    assert m2.last_node.key == [6, 7]
    assert tree.match_prefix([2, 1]).slots.numel() == 0
    assert tree.match_prefix([2, 1]).last_node is tree.root


def test_insert_splits_mid_edge_and_returns_existing_len():
    alloc, tree = make(1)
    a = alloc.alloc_extend(0, 0, 4)
    tree.insert([1, 2, 3, 4], a)
    b = alloc.alloc_extend(0, 0, 2)
    assert tree.insert([1, 2], b) == 2  # fully present: the tree keeps its own slots
    assert tree.total_size() == 4
    assert tree.match_prefix([1, 2]).slots.tolist() == a[:2].tolist()


def test_page_alignment_page_size_four():
    alloc, tree = make(4)
    key = [PAD + i for i in range(10)]
    slots = alloc.alloc_extend(0, 0, 10)
    assert tree.insert(key, slots) == 0
    assert tree.total_size() == 8  # the 2-token tail is not stored

    assert tree.match_prefix(key).slots.tolist() == slots[:8].tolist()
    assert tree.match_prefix(key[:3]).slots.numel() == 0

    # Differs inside page 1 of the single 8-token edge: only page 0 matches, and the split is page aligned.
    diverge = key[:5] + [0] + key[6:]
    m = tree.match_prefix(diverge)
    assert m.slots.tolist() == slots[:4].tolist()
    assert m.last_node.key == key[:4]
    assert list(m.last_node.children) == [tuple(key[4:8])]  # children keyed by the first page
    assert tree.match_prefix(key[:7]).slots.tolist() == slots[:4].tolist()

    other = alloc.alloc_extend(0, 0, 8)
    assert tree.insert(diverge[:8], other) == 4
    assert tree.total_size() == 12
    assert tree.match_prefix(diverge).slots.tolist() == slots[:4].tolist() + other[4:8].tolist()


def test_insert_copies_slots_so_the_callers_row_can_be_reused():
    alloc, tree = make(1)
    row = torch.zeros(8, dtype=torch.int64)
    row[:3] = alloc.alloc_extend(0, 0, 3)
    expected = row[:3].tolist()
    tree.insert([1, 2, 3], row[:3])
    row[:3] = 0  # the request table row is handed to the next request
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == expected


def test_huge_keys_are_not_truncated():
    alloc, tree = make(1)
    add(alloc, tree, [PAD + 1, PAD + 2])
    assert tree.match_prefix([PAD + 1, PAD + 3]).slots.numel() == 1
    assert tree.match_prefix([PAD + 1 - 2**32, PAD + 2]).slots.numel() == 0  # same low 32 bits


@pytest.mark.parametrize("page_size", [1, 4])
def test_lock_prevents_eviction(page_size):
    alloc, tree = make(page_size)
    a_key = [1] * (2 * page_size)
    b_key = [2] * (3 * page_size)
    add(alloc, tree, a_key)
    add(alloc, tree, b_key)
    m = tree.match_prefix(a_key)
    assert tree.inc_lock_ref(m.last_node) == -len(a_key)
    assert tree.protected_size() == len(a_key)
    assert tree.evictable_size() == len(b_key)

    assert tree.evict(10**6) == len(b_key)
    assert tree.match_prefix(a_key).slots.tolist() == m.slots.tolist()
    assert tree.evict(10**6) == 0

    assert tree.dec_lock_ref(m.last_node) == len(a_key)
    assert tree.evict(1) == len(a_key)
    assert alloc.num_free_pages == alloc.num_pages


def test_locking_a_child_protects_its_ancestors():
    alloc, tree = make(1)
    add(alloc, tree, [1, 2, 3])
    add(alloc, tree, [1, 2, 4])  # splits into [1, 2] -> {[3], [4]}
    leaf = tree.match_prefix([1, 2, 3]).last_node
    tree.inc_lock_ref(leaf)
    assert tree.protected_size() == 3 and tree.evictable_size() == 1
    assert tree.evict(10) == 1  # only [4]; [1, 2] is an ancestor of a locked leaf
    assert tree.total_size() == 3
    tree.dec_lock_ref(leaf)
    assert tree.evictable_size() == 3 and tree.protected_size() == 0
    with pytest.raises(AssertionError, match="unlocked"):
        tree.dec_lock_ref(leaf)  # one unlock too many is a bookkeeping bug


def test_lru_eviction_order():
    alloc, tree = make(1)
    add(alloc, tree, [1, 1])
    add(alloc, tree, [2, 2])
    add(alloc, tree, [3, 3])
    tree.match_prefix([1, 1])  # [1, 1] is now the most recently used
    assert tree.evict(1) == 2
    assert tree.match_prefix([2, 2]).slots.numel() == 0  # the oldest untouched one went first
    assert tree.match_prefix([3, 3]).slots.numel() == 2
    assert tree.evict(1) == 2  # [3, 3] was just touched, [1, 1] is older now
    assert tree.match_prefix([1, 1]).slots.numel() == 0
    assert tree.total_size() == 2


def test_parent_becomes_evictable_after_its_children():
    alloc, tree = make(1)
    add(alloc, tree, [1, 2, 3])
    add(alloc, tree, [1, 2, 4])
    assert tree.evict(5) == 4
    assert tree.total_size() == 0 and tree.root.is_leaf
    assert alloc.num_free_pages == alloc.num_pages


def test_evict_returns_exactly_the_nodes_slots_to_the_allocator():
    alloc, tree = make(2, num_pages=8)
    a = add(alloc, tree, [1, 2, 3, 4])
    b = add(alloc, tree, [5, 6])
    assert alloc.num_free_pages == 5
    tree.match_prefix([5, 6])
    assert tree.evict(1) == 4
    a_pages = set(((a - 1) // 2).tolist())
    b_pages = set(((b - 1) // 2).tolist())
    free = set(alloc.free_page_ids().tolist())
    assert a_pages <= free and b_pages.isdisjoint(free)
    assert alloc.num_free_pages == 7


def test_cache_finished_req_frees_duplicates_and_unaligned_tail():
    alloc, tree = make(4, num_pages=8)
    key = list(range(100, 110))
    # Two requests with the same prompt ran concurrently, neither matched anything.
    r1 = alloc.alloc_extend(0, 0, 10)
    r2 = alloc.alloc_extend(0, 0, 10)
    assert alloc.num_free_pages == 2
    tree.cache_finished_req(key, r1, 0, tree.root)
    assert alloc.num_free_pages == 3  # r1's partial third page
    tree.cache_finished_req(key, r2, 0, tree.root)
    assert alloc.num_free_pages == 6  # r2's two duplicate pages and its partial page
    assert tree.match_prefix(key).slots.tolist() == r1[:8].tolist()
    assert tree.evict(100) == 8
    assert alloc.num_free_pages == 8


def test_request_lifecycle_with_match_decode_and_finish():
    alloc, tree = make(4, num_pages=8)
    prompt = [7] * 9
    add(alloc, tree, prompt)  # caches 8 tokens
    m = tree.match_prefix(prompt[:-1])
    cached_len = len(m.slots)
    assert cached_len == 8
    tree.inc_lock_ref(m.last_node)
    new = alloc.alloc_extend(cached_len, int(m.slots[-1]), 1)
    assert new is not None
    row = torch.cat((m.slots, new))
    for _ in range(4):  # decode, one token a step
        nxt = alloc.alloc_extend(len(row), int(row[-1]), 1)
        assert nxt is not None
        row = torch.cat((row, nxt))
    tokens = prompt + [8, 8, 8, 8]
    # Slots allocated for tokens that never ran (here crossing into a new page) are freed too.
    unused = alloc.alloc_extend(len(row), int(row[-1]), 4)
    assert unused is not None
    tree.cache_finished_req(tokens, torch.cat((row, unused)), cached_len, m.last_node)
    assert tree.protected_size() == 0
    assert tree.total_size() == 12
    assert tree.evict(10**6) == 12
    assert alloc.num_free_pages == alloc.num_pages


def test_cache_unfinished_req_swaps_duplicates_and_moves_the_lock():
    alloc, tree = make(2, num_pages=8)
    key = [1, 2, 3, 4, 5]
    other = add(alloc, tree, key[:4])  # another request already cached [1, 2, 3, 4]
    row = alloc.alloc_extend(0, 0, 5)
    m = tree.cache_unfinished_req(key, row, 0, tree.root)
    assert m.slots.tolist() == other[:4].tolist()
    assert tree.protected_size() == 4 and m.last_node.lock_ref == 1
    assert alloc.num_free_pages == 8 - 2 - 1  # tree's 2 pages + our partial page; our duplicates freed
    row = torch.cat((m.slots, row[4:]))
    more = alloc.alloc_extend(5, int(row[-1]), 1)
    row = torch.cat((row, more))
    tree.cache_finished_req(key + [6], row, len(m.slots), m.last_node)
    assert tree.protected_size() == 0 and tree.total_size() == 6
    tree.evict(10**6)
    assert alloc.num_free_pages == alloc.num_pages


def test_disabled_cache_stores_nothing_and_frees_everything():
    alloc, tree = make(2, num_pages=4, disable=True)
    slots = alloc.alloc_extend(0, 0, 5)
    assert tree.insert([1, 2, 3, 4, 5], slots) == 0
    assert tree.total_size() == 0
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.slots.numel() == 0 and m.last_node is tree.root
    assert tree.inc_lock_ref(m.last_node) == 0
    assert tree.evict(100) == 0
    tree.cache_finished_req([1, 2, 3, 4, 5], slots, 0, m.last_node)
    assert alloc.num_free_pages == 4


def test_reset_returns_slots_and_refuses_while_locked():
    alloc, tree = make(1)
    add(alloc, tree, [1, 2, 3])
    m = tree.match_prefix([1, 2])
    tree.inc_lock_ref(m.last_node)
    with pytest.raises(AssertionError):
        tree.reset()
    tree.dec_lock_ref(m.last_node)
    tree.reset()
    assert tree.total_size() == 0 and tree.evictable_size() == 0
    assert alloc.num_free_pages == alloc.num_pages


def test_format_tree_shows_structure():
    alloc, tree = make(1)
    add(alloc, tree, [1, 2, 3])
    add(alloc, tree, [1, 2, 4])
    lines = tree.format_tree().splitlines()
    assert lines[0].startswith("root (total=4")
    assert lines[1].startswith("  [2] key=[1, 2]")
    assert sorted(line.split(" slots")[0] for line in lines[2:]) == ["    [1] key=[3]", "    [1] key=[4]"]


# ---- randomized property test -------------------------------------------------------------------------------


@dataclass(eq=False)  # identity: two requests may carry equal tokens
class Req:
    tokens: list[int]  # tokens whose KV is written, one per slot
    slots: torch.Tensor
    cached_len: int
    last_node: TreeNode


def pages_of(slots: torch.Tensor, page_size: int) -> set[int]:
    return set(((slots - 1) // page_size).tolist())


def check_invariants(alloc: PagedTokenAllocator, tree: RadixCache, active: list[Req],
                     kv: dict[int, tuple[int, ...]]) -> None:
    ps = alloc.page_size
    tree_pages: set[int] = set()
    expected_locks: dict[int, int] = {}
    for req in active:
        node = req.last_node
        while node is not tree.root:
            expected_locks[node.id] = expected_locks.get(node.id, 0) + 1
            node = node.parent
    stack = [(child, []) for child in tree.root.children.values()]
    protected = total = 0
    while stack:
        node, path = stack.pop()
        full = path + node.key
        assert len(node.key) % ps == 0 and len(node.key) > 0
        assert node.lock_ref == expected_locks.get(node.id, 0)
        # Whole pages, token i at in-page offset i % ps.
        assert (((node.value - 1) % ps) == torch.arange(len(path), len(full)) % ps).all()
        pages = pages_of(node.value, ps)
        assert len(pages) == len(node.key) // ps and tree_pages.isdisjoint(pages)
        tree_pages |= pages
        for i, slot in enumerate(node.value.tolist()):  # KV was computed for exactly this prefix
            assert kv[slot] == tuple(full[: len(path) + i + 1])
        total += len(node.key)
        protected += len(node.key) if node.lock_ref else 0
        stack.extend((child, full) for child in node.children.values())
    assert tree.total_size() == total
    assert tree.protected_size() == protected and tree.evictable_size() == total - protected

    owned = set(tree_pages)
    for req in active:
        assert pages_of(req.slots[: req.cached_len], ps) <= tree_pages
        mine = pages_of(req.slots[req.cached_len:], ps)
        assert owned.isdisjoint(mine), "a page has two owners"
        owned |= mine
        for i, slot in enumerate(req.slots.tolist()):
            assert kv[slot] == tuple(req.tokens[: i + 1])
    free = set(alloc.free_page_ids().tolist())
    assert len(free) == alloc.num_free_pages, "a page is on the free list twice"
    assert free.isdisjoint(owned) and free | owned == set(range(alloc.num_pages)), "leaked page"


def write_kv(kv: dict[int, tuple[int, ...]], tokens: list[int], slots: torch.Tensor, start: int) -> None:
    for i, slot in enumerate(slots.tolist(), start):
        kv[slot] = tuple(tokens[: i + 1])


token_st = st.sampled_from([1, 2, 3, PAD + 1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 16), data=st.data())
def test_random_request_sequences_never_leak(page_size, num_pages, data):
    alloc, tree = make(page_size, num_pages)
    active: list[Req] = []
    seen: list[list[int]] = [[]]
    kv: dict[int, tuple[int, ...]] = {}

    def finish(req: Req) -> None:
        tree.cache_finished_req(req.tokens, req.slots, req.cached_len, req.last_node)
        active.remove(req)

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        action = data.draw(st.sampled_from(["start", "start", "decode", "chunk", "finish", "abort"]))
        if action == "start":
            base = data.draw(st.sampled_from(seen))
            prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(token_st, min_size=1,
                                                                                     max_size=12))
            seen.append(prompt)
            m = tree.match_prefix(prompt[:-1])
            write_check = [kv[s] for s in m.slots.tolist()]
            assert write_check == [tuple(prompt[: i + 1]) for i in range(len(m.slots))]
            cached_len = len(m.slots)
            assert cached_len % page_size == 0 and cached_len <= len(prompt) - 1
            tree.inc_lock_ref(m.last_node)
            extend_len = len(prompt) - cached_len
            need = alloc.num_pages_needed(cached_len, extend_len) * page_size
            if need > alloc.available_size():
                tree.evict(need - alloc.available_size())
            last_slot = int(m.slots[-1]) if cached_len else 0
            new = alloc.alloc_extend(cached_len, last_slot, extend_len)
            if new is None:
                assert tree.evictable_size() == 0 and need > alloc.available_size()
                tree.dec_lock_ref(m.last_node)
            else:
                write_kv(kv, prompt, new, cached_len)
                active.append(Req(prompt, torch.cat((m.slots, new)), cached_len, m.last_node))
        elif active and action == "decode":
            req = data.draw(st.sampled_from(active))
            req.tokens.append(data.draw(token_st))
            new = alloc.alloc_extend(len(req.slots), int(req.slots[-1]), 1)
            if new is None:
                tree.evict(page_size)
                new = alloc.alloc_extend(len(req.slots), int(req.slots[-1]), 1)
            if new is None:
                req.tokens.pop()
            else:
                write_kv(kv, req.tokens, new, len(req.slots))
                req.slots = torch.cat((req.slots, new))
        elif active and action == "chunk":
            req = data.draw(st.sampled_from(active))
            m = tree.cache_unfinished_req(req.tokens, req.slots, req.cached_len, req.last_node)
            assert len(m.slots) == len(req.tokens) // page_size * page_size
            req.slots = torch.cat((m.slots, req.slots[len(m.slots):]))
            req.cached_len, req.last_node = len(m.slots), m.last_node
        elif active and action == "finish":
            finish(data.draw(st.sampled_from(active)))
        elif active and action == "abort":
            req = data.draw(st.sampled_from(active))
            alloc.free(req.slots[req.cached_len:])
            tree.dec_lock_ref(req.last_node)
            active.remove(req)
        check_invariants(alloc, tree, active, kv)

    while active:
        finish(active[0])
    check_invariants(alloc, tree, active, kv)
    total = tree.total_size()
    assert tree.evict(10**9) == total
    assert tree.total_size() == 0 and tree.root.is_leaf
    assert tree.evictable_size() == 0 and tree.protected_size() == 0
    assert sorted(alloc.free_page_ids().tolist()) == list(range(alloc.num_pages))
