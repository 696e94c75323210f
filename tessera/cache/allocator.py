"""Paged KV-slot allocator: which slots of the TokenToKVPool are free, handed out a page at a time.

Slots are 1..size (slot 0 is the pool's dummy and is never handed out). Slots are grouped into pages of
`page_size` consecutive slots: page p covers slots [1 + p*page_size, 1 + (p+1)*page_size).

Invariant the callers keep (and `alloc_extend` checks): token i of a request sits at in-page offset
i % page_size. Prefixes shared through the radix cache are whole pages, so a request can always continue
filling its own last page without touching anyone else's.

Ownership: every allocated page has exactly one owner, either one request or the radix cache. `free` works
on whole pages, so a caller may only pass slots of pages it owns.
"""

from __future__ import annotations

import torch


class PagedTokenAllocator:
    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"size ({size}) must hold at least one page of page_size {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        # Rounded down to whole pages: the last size % page_size slots of the pool are never used.
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        """Marks every page free. Only valid when nobody (no request, no radix cache) holds slots."""
        # The free list is a FIFO queue in a ring buffer of num_pages entries (never more are free): alloc
        # takes from the head, free appends at the tail, each O(pages moved) with no per-slot Python work.
        # (Concatenating onto the list copied all of it per free: 25 ms for a 1024-token request at a
        # 4M-token pool of pages of 1, against 0.25 ms now.)
        self._ring = torch.arange(self.num_pages, dtype=torch.int64, device=self.device)
        self._head = 0  # ring index of the oldest free page
        self._num_free = self.num_pages
        # Mirrors the free list so double frees are caught with one vectorised lookup.
        self._page_is_free = torch.ones(self.num_pages, dtype=torch.bool, device=self.device)

    def _ring_positions(self, start: int, count: int) -> torch.Tensor:
        """Ring indices of `count` consecutive entries from ring index `start` (wrapping)."""
        return torch.arange(start, start + count, dtype=torch.int64, device=self.device) % self.num_pages

    # ---- sizes -------------------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    def available_size(self) -> int:
        """Free token slots (whole free pages times page_size); what admission control budgets against."""
        return self.num_free_tokens

    def num_pages_needed(self, prefix_len: int, extend_len: int) -> int:
        """Pages `alloc_extend(prefix_len, _, extend_len)` would take from the free list."""
        fill = min((-prefix_len) % self.page_size, extend_len) if prefix_len > 0 else 0
        return -(-(extend_len - fill) // self.page_size)

    # ---- alloc / free ------------------------------------------------------------------------------------

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Takes `num_pages` pages off the free list: long tensor of page ids, or None (and nothing taken)
        when fewer are free."""
        assert num_pages >= 0, num_pages
        if num_pages > self._num_free:
            return None
        if self._head + num_pages <= self.num_pages:  # a copy: the ring's entries are overwritten by frees
            pages = self._ring[self._head:self._head + num_pages].clone()
        else:
            pages = self._ring[self._ring_positions(self._head, num_pages)]
        self._head = (self._head + num_pages) % self.num_pages
        self._num_free -= num_pages
        self._page_is_free[pages] = False
        return pages

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of `pages`, page by page: [len(pages) * page_size]."""
        if self.page_size == 1:  # one op, not four: every prefill chunk of a request comes here
            return pages + 1
        return (pages[:, None] * self.page_size + 1 + self._page_offsets).flatten()

    def alloc_extend(self, prefix_len: int, last_slot: int, extend_len: int) -> torch.Tensor | None:
        """Slots for `extend_len` new tokens of a request that already has `prefix_len` tokens, the last of
        which sits at `last_slot` (ignored when prefix_len == 0).

        The first min(extend_len, (-prefix_len) % page_size) tokens go to last_slot+1, last_slot+2, ... (the
        rest of the request's own partially filled page); the others get freshly allocated whole pages, so
        the unused end of the last new page also belongs to the request. Returns a long tensor
        [extend_len], or None with nothing allocated when not enough pages are free.
        """
        assert prefix_len >= 0 and extend_len >= 0, (prefix_len, extend_len)
        page_size = self.page_size
        fill = 0
        if prefix_len > 0:
            assert 1 <= last_slot <= self.size, f"last_slot {last_slot} outside 1..{self.size}"
            assert (last_slot - 1) % page_size == (prefix_len - 1) % page_size, (
                f"token {prefix_len - 1} must sit at in-page offset {(prefix_len - 1) % page_size}, "
                f"but slot {last_slot} is at offset {(last_slot - 1) % page_size}")
            fill = min((-prefix_len) % page_size, extend_len)
        pages = self.alloc_pages(-(-(extend_len - fill) // page_size))
        if pages is None:
            return None
        new_slots = self.pages_to_slots(pages)[: extend_len - fill]
        if fill == 0:
            return new_slots
        head = torch.arange(last_slot + 1, last_slot + 1 + fill, dtype=torch.int64, device=self.device)
        return torch.cat((head, new_slots))

    def free(self, slots: torch.Tensor) -> None:
        """Returns to the free list every page that contains at least one of `slots`.

        The caller must own those whole pages (see the module docstring). Freeing a page that is already
        free is a bookkeeping bug and raises AssertionError.
        """
        if slots.numel() == 0:
            return
        assert not slots.is_floating_point(), f"slots must be integer, got {slots.dtype}"
        assert bool(((slots >= 1) & (slots <= self.size)).all()), f"slot outside 1..{self.size}: {slots}"
        pages = torch.unique((slots.to(self.device, torch.int64) - 1) // self.page_size)
        already_free = self._page_is_free[pages]
        assert not bool(already_free.any()), f"double free of page(s) {pages[already_free].tolist()}"
        self._page_is_free[pages] = True
        self._ring[self._ring_positions(self._head + self._num_free, len(pages))] = pages
        self._num_free += len(pages)

    def free_page_ids(self) -> torch.Tensor:
        """A copy of the free list (page ids, in the order alloc takes them), for leak checks in tests and
        debugging."""
        return self._ring[self._ring_positions(self._head, self._num_free)]
