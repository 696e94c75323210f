"""KVManager: a request's KV bookkeeping on the scheduler's side. It owns the request slot table, the page
allocator and the radix cache and pairs their calls: admission (a row and the cached prefix), slots for new
tokens (one request, or one for every decoding request at once), truncation of rejected drafts, release (whole
pages to the radix cache), and the journal of slot-table writes the worker's copy replays."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.messages.worker import SlotWrite, TokenSlotWrites
from tessera.scheduler.req import Req


class KVManager:
    """Owns the request slot table, the page allocator and the radix cache; pairs their calls.

    Every slot-table write is also journaled (take_pending), so the model worker's copy of the table is
    brought up to date by the next ForwardInput; so are the requests that left, whose worker state can go.
    """

    def __init__(self, req_pool: ReqToTokenPool, allocator: PagedTokenAllocator, tree: RadixCache, page_size: int,
                 extra_slots: Callable[[Req], int] | None = None):
        self.req_pool, self.allocator, self.tree, self.page_size = req_pool, allocator, tree, page_size
        # Slots an admitted request also holds for its family's per-request state (RequestState.extra_slots:
        # cross-attention K/V of its media); None for most families.
        self.extra_slots = extra_slots
        self.state_tokens = 0  # slots held for per-request state now (a /metrics gauge)
        self.prefix_hit_tokens = 0
        self.prefix_total_tokens = 0
        self._slot_writes: list[SlotWrite | TokenSlotWrites] = []
        self._released: list[str] = []

    def _write(self, row: int, start: int, slots: torch.Tensor, owned: bool = False) -> None:
        """owned: `slots` is a fresh tensor nobody else writes (the allocator's), so the journal keeps it
        without a copy."""
        if slots.numel():
            self.req_pool.req_to_token[row, start:start + slots.shape[0]] = slots
            self._slot_writes.append(SlotWrite(row, start, slots if owned else slots.clone()))

    def take_pending(self) -> tuple[list[SlotWrite | TokenSlotWrites], list[str]]:
        """The slot-table writes and released request ids since the last call (for the next ForwardInput)."""
        writes, released = self._slot_writes, self._released
        self._slot_writes, self._released = [], []
        return writes, released

    def admit(self, req: Req) -> bool:
        """Gives req a slot-table row and its cached prefix. False if no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        extra = self.extra_slots(req) if self.extra_slots is not None else 0
        if extra:
            # Taken at admission, whole pages of their own (a virtual sequence from 0): the pool budget covers
            # them like any KV, and a request that cannot get them waits.
            state = self.allocator.alloc_extend(0, 0, extra)
            if state is None:
                self.tree.evict(extra + self.page_size)
                state = self.allocator.alloc_extend(0, 0, extra)
            if state is None:
                self.req_pool.free(row)
                return False
            req.state_slots, req.state_filled = state, False
            self.state_tokens += int(state.numel())
        req.req_pool_idx = row
        key = req.cache_key()
        # Leave at least one token to compute: its logits produce the next token. A request that asks for
        # prompt logprobs matches no further than their first row (SGLang's logprob_start_len handling).
        limit = req.seq_len - 1
        if req.wants_input_logprobs and not req.input_logprobs_done:
            limit = min(limit, req.input_logprob_rows()[0])
        if req.pooling is not None and req.pooling.uses_every_row:  # mean / CLS pooling read every prompt row
            limit = 0
        match = self.tree.match_prefix(key[:limit])
        n = int(match.slots.numel())
        cut = next((lo for lo, hi in req.atomic_spans if lo < n < hi), None)
        if cut is not None:  # a cached prefix may not end inside a span that must be computed whole
            match = self.tree.match_prefix(key[:cut])
            n = int(match.slots.numel())
        self._write(row, 0, match.slots)
        self.tree.inc_lock_ref(match.last_node)
        req.last_node, req.prefix_len, req.kv_len = match.last_node, n, n
        return True

    def count_hit(self, req: Req) -> None:
        """Prefix-cache statistics, once per request: when it starts running for the first time."""
        if req.num_retractions == 0:
            req.cached_len = min(req.prefix_len, len(req.origin_input_ids))
            self.prefix_hit_tokens += req.cached_len
            self.prefix_total_tokens += len(req.origin_input_ids)

    def alloc(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Slots for the next num_tokens of req, evicting cached prefixes if needed."""
        last_slot = int(self.req_pool.req_to_token[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else 0
        slots = self.allocator.alloc_extend(req.kv_len, last_slot, num_tokens)
        if slots is None:
            self.tree.evict(num_tokens + self.page_size)
            slots = self.allocator.alloc_extend(req.kv_len, last_slot, num_tokens)
        if slots is not None:
            self._write(req.req_pool_idx, req.kv_len, slots, owned=True)
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot each for the next token of every request of `reqs` (all past their prefill), in a few
        tensor ops for the whole batch: [len(reqs)] slots, or None with nothing taken when the free pages do
        not cover them (the caller then goes request by request through alloc, evicting and retracting).

        Per request, alloc's slicing and table writes cost ~80 us on a CPU: 4 ms of a 20 ms decode step
        at batch 48 (demo-vl)."""
        table = self.req_pool.req_to_token
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        slots = table[rows, cols - 1] + 1  # the next slot of the request's own last page...
        fresh = cols % self.page_size == 0  # ...unless that page is full: a new page's first slot
        pages = self.allocator.alloc_pages(int(fresh.sum()))
        if pages is None:
            return None
        slots[fresh] = pages * self.page_size + 1
        table[rows, cols] = slots
        self._slot_writes.append(TokenSlotWrites(rows, cols, slots))
        return slots

    def truncate(self, req: Req, kv_len: int) -> None:
        """Gives back the slots of req's tokens from kv_len on (a verify step's rejected drafts). With pages of
        several tokens the page holding token kv_len - 1 stays the request's: its next slots continue it."""
        row, old = req.req_pool_idx, req.kv_len
        if row is None or kv_len >= old:
            return
        slots = self.req_pool.req_to_token[row, kv_len:old]
        if self.page_size > 1 and kv_len > 0:
            kept_page = (int(self.req_pool.req_to_token[row, kv_len - 1]) - 1) // self.page_size
            slots = slots[(slots - 1) // self.page_size != kept_page]
        self.allocator.free(slots)
        req.kv_len = kv_len

    def release(self, req: Req, allocated_len: int | None = None, freed: list[torch.Tensor] | None = None) -> None:
        """Returns req's KV: whole computed pages go to the radix cache, the rest to the allocator.

        allocated_len: slots held beyond kv_len (only after a failed step); normally every
        allocated slot has had its KV written (allocation and forward share a step). freed: collects the
        slots for the allocator instead (release_all frees a step's in one call).
        """
        row = req.req_pool_idx
        if row is None:
            return
        if req.state_slots is not None:
            self.allocator.free(req.state_slots)
            self.state_tokens -= int(req.state_slots.numel())
            req.state_slots, req.state_filled = None, False
        slots = self.req_pool.req_to_token[row, : max(req.kv_len, allocated_len or 0)].clone()
        self.tree.cache_finished_req(req.cache_key()[: req.kv_len], slots, req.prefix_len, req.last_node, freed)
        self.req_pool.free(row)
        self._released.append(req.rid)
        req.req_pool_idx, req.last_node, req.kv_len, req.prefix_len = None, None, 0, 0

    def release_all(self, reqs: list[Req]) -> None:
        """release() of each, their slots back to the allocator in one call: a step's embedding requests all
        finish together, and the allocator's checks cost ~70 us a call on a CPU (64 requests: 4 ms a step)."""
        freed: list[torch.Tensor] = []
        for req in reqs:
            self.release(req, freed=freed)
        if freed:
            self.allocator.free(torch.cat(freed))

    def cache_prefill(self, req: Req) -> None:
        """After a prefill chunk: share its whole pages through the radix cache right away, so
        requests admitted later (same system prompt, same image) reuse them."""
        row = req.req_pool_idx
        key = req.cache_key()[: req.kv_len]
        m = self.tree.cache_unfinished_req(key, self.req_pool.req_to_token[row, : req.kv_len].clone(),
                                           req.prefix_len, req.last_node)
        n = int(m.slots.numel())
        self._write(row, req.prefix_len, m.slots[req.prefix_len:])
        req.prefix_len, req.last_node = n, m.last_node
