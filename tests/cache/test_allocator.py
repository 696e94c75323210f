import torch

import pytest

from tessera.cache.allocator import PagedTokenAllocator


def test_size_rounds_down_to_whole_pages():
    alloc = PagedTokenAllocator(size=10, page_size=4)
    assert alloc.num_pages == 2
    assert alloc.size == 8
    assert alloc.num_free_pages == 2
    assert alloc.num_free_tokens == 8
    assert alloc.available_size() == 8


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="page_size"):
        PagedTokenAllocator(size=8, page_size=0)
    with pytest.raises(ValueError, match="size"):
        PagedTokenAllocator(size=3, page_size=4)


def test_pages_cover_slots_one_to_size_without_slot_zero():
    alloc = PagedTokenAllocator(size=12, page_size=4)
    pages = alloc.alloc_pages(3)
    assert pages is not None
    slots = alloc.pages_to_slots(pages)
    assert sorted(slots.tolist()) == list(range(1, 13))
    # Page p is [1 + 4p, 1 + 4(p+1)).
    for p in pages.tolist():
        page_slots = alloc.pages_to_slots(torch.tensor([p])).tolist()
        assert page_slots == list(range(1 + 4 * p, 5 + 4 * p))


def test_alloc_free_round_trip():
    alloc = PagedTokenAllocator(size=16, page_size=2)
    a = alloc.alloc_pages(3)
    b = alloc.alloc_pages(5)
    assert a is not None and b is not None
    assert set(a.tolist()).isdisjoint(b.tolist())
    assert alloc.num_free_pages == 0
    assert alloc.alloc_pages(1) is None
    alloc.free(alloc.pages_to_slots(a))
    assert alloc.num_free_pages == 3
    alloc.free(alloc.pages_to_slots(b))
    assert sorted(alloc.free_page_ids().tolist()) == list(range(8))
    again = alloc.alloc_pages(8)
    assert again is not None and sorted(again.tolist()) == list(range(8))


def test_no_partial_allocation():
    alloc = PagedTokenAllocator(size=8, page_size=2)
    assert alloc.alloc_pages(3) is not None
    assert alloc.alloc_pages(2) is None  # only one page left
    assert alloc.num_free_pages == 1
    assert alloc.alloc_extend(0, 0, 3) is None  # needs two pages
    assert alloc.num_free_pages == 1
    assert alloc.alloc_extend(0, 0, 2) is not None
    assert alloc.num_free_pages == 0


def test_alloc_extend_fills_partial_page_first():
    alloc = PagedTokenAllocator(size=16, page_size=4)
    first = alloc.alloc_extend(0, 0, 3)
    assert first is not None and first.dtype == torch.int64
    assert first.tolist() == [1, 2, 3]  # page 0, slot 4 left unused
    assert alloc.num_free_pages == 3

    second = alloc.alloc_extend(3, 3, 4)
    assert second is not None
    # slot 4 finishes page 0, then page 1 (slots 5..8) is taken for the other three.
    assert second.tolist() == [4, 5, 6, 7]
    assert alloc.num_free_pages == 2

    third = alloc.alloc_extend(7, 7, 1)
    assert third is not None and third.tolist() == [8]
    assert alloc.num_free_pages == 2  # no new page: it fit in the partial one

    fourth = alloc.alloc_extend(8, 8, 1)  # page full: needs a new one
    assert fourth is not None and fourth.tolist() == [9]
    assert alloc.num_free_pages == 1


def test_alloc_extend_within_partial_page_takes_no_page():
    alloc = PagedTokenAllocator(size=8, page_size=4)
    head = alloc.alloc_extend(0, 0, 1)
    assert head is not None and head.tolist() == [1]
    more = alloc.alloc_extend(1, 1, 2)
    assert more is not None and more.tolist() == [2, 3]
    assert alloc.num_free_pages == 1


def test_alloc_extend_failure_allocates_nothing_even_with_partial_page():
    alloc = PagedTokenAllocator(size=8, page_size=4)
    head = alloc.alloc_extend(0, 0, 6)
    assert head is not None
    # 2 slots left in the partial page + 4 more would need one page, but none is free.
    assert alloc.alloc_extend(6, int(head[-1]), 3) is None
    assert alloc.num_free_pages == 0
    assert alloc.alloc_extend(6, int(head[-1]), 2).tolist() == [7, 8]


def test_alloc_extend_rejects_misaligned_last_slot():
    alloc = PagedTokenAllocator(size=16, page_size=4)
    slots = alloc.alloc_extend(0, 0, 2)
    assert slots is not None
    with pytest.raises(AssertionError, match="offset"):
        alloc.alloc_extend(2, int(slots[0]), 1)  # token 1 is at slot 2, not slot 1


@pytest.mark.parametrize("prefix_len,extend_len", [(0, 0), (0, 1), (0, 4), (0, 5), (3, 1), (3, 2), (4, 1),
                                                   (5, 11), (7, 0)])
def test_num_pages_needed_matches_alloc_extend(prefix_len, extend_len):
    alloc = PagedTokenAllocator(size=64, page_size=4)
    last_slot = 0
    if prefix_len:
        prefix = alloc.alloc_extend(0, 0, prefix_len)
        assert prefix is not None
        last_slot = int(prefix[-1])
    before = alloc.num_free_pages
    expected = alloc.num_pages_needed(prefix_len, extend_len)
    slots = alloc.alloc_extend(prefix_len, last_slot, extend_len)
    assert slots is not None and len(slots) == extend_len
    assert before - alloc.num_free_pages == expected


def test_free_releases_whole_page_once_for_several_slots():
    alloc = PagedTokenAllocator(size=8, page_size=4)
    slots = alloc.alloc_extend(0, 0, 6)
    assert slots is not None
    alloc.free(slots)  # 6 slots in 2 pages
    assert alloc.num_free_pages == 2
    assert sorted(alloc.free_page_ids().tolist()) == [0, 1]


def test_free_of_empty_tensor_is_a_noop():
    alloc = PagedTokenAllocator(size=8, page_size=2)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.num_free_pages == 4


def test_double_free_asserts():
    alloc = PagedTokenAllocator(size=8, page_size=2)
    slots = alloc.alloc_extend(0, 0, 4)
    assert slots is not None
    alloc.free(slots[:2])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[:1])
    # A batch mixing a held page with a free one is rejected without freeing the held one.
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots)
    assert alloc.num_free_pages == 3
    alloc.free(slots[2:])
    assert alloc.num_free_pages == 4


def test_never_allocated_page_cannot_be_freed():
    alloc = PagedTokenAllocator(size=8, page_size=2)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(torch.tensor([3]))


def test_slot_zero_and_out_of_range_slots_assert():
    alloc = PagedTokenAllocator(size=8, page_size=2)
    assert alloc.alloc_pages(4) is not None
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([0]))
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([9]))


def test_page_size_one_hands_out_distinct_slots():
    alloc = PagedTokenAllocator(size=5, page_size=1)
    a = alloc.alloc_extend(0, 0, 3)
    b = alloc.alloc_extend(3, int(a[-1]), 2)
    assert a is not None and b is not None
    assert sorted(a.tolist() + b.tolist()) == [1, 2, 3, 4, 5]
    assert alloc.alloc_extend(5, int(b[-1]), 1) is None
    alloc.free(torch.cat((a, b)))
    assert alloc.num_free_tokens == 5


def test_free_list_is_first_in_first_out_across_the_ring_wrap():
    """Against a Python list: alloc takes the oldest free pages, free appends; thousands of random steps wrap
    the ring buffer many times."""
    import random

    rng = random.Random(0)
    alloc = PagedTokenAllocator(size=7 * 3, page_size=3)
    free, held = list(range(7)), []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            batch = rng.sample(held, rng.randint(1, len(held)))
            slots = alloc.pages_to_slots(torch.tensor(batch))[::2]  # some slots of each page name it
            alloc.free(slots)
            held = [p for p in held if p not in batch]
            free += sorted(batch)  # a freed batch enters in page order
        else:
            n = rng.randint(0, 4)
            pages = alloc.alloc_pages(n)
            if n > len(free):
                assert pages is None
                continue
            assert pages is not None and pages.tolist() == free[:n]
            held += free[:n]
            free = free[n:]
        assert alloc.free_page_ids().tolist() == free and alloc.num_free_pages == len(free)


def test_allocated_pages_keep_their_values_when_the_ring_is_reused():
    alloc = PagedTokenAllocator(size=4, page_size=1)
    a = alloc.alloc_pages(2)
    alloc.alloc_pages(2)
    alloc.free(alloc.pages_to_slots(a[1:]))  # written where a's entries were in the ring
    assert a.tolist() == [0, 1]
    b = alloc.alloc_pages(1)
    assert b.tolist() == [1]
