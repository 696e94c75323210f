"""Admission, chunked prefill, KV allocation and retraction: how one step's batch is formed.

Per step: every running request that is ready to decode gets one token; then requests that
are mid-prefill, then waiting ones (FCFS, or longest-prefix-match first with `lpm`), get
prefill chunks until `chunked_prefill_size` tokens are scheduled, and at most `max_prefill_tokens`
prompt tokens (SGLang's meaning: across the step's prefills; the first prefill of a step is never held
back by it, so a longer prompt still runs, alone, in chunks of `chunked_prefill_size`; a waiting request
whose uncached prompt does not fit what is left waits for the next step). When the KV pool runs out
the radix cache is evicted first; if a decode still cannot get a slot, the most recently
arrived running request is retracted: its KV goes into the prefix cache (so resuming is
mostly a cache hit), and it returns to the front of the waiting queue with its output kept.

In-batch prefix sharing: requests that arrive together with the same system prompt or image
would each compute it, because the radix cache only learns a prefix after the step that computes
it. So a waiting request that shares at least IN_BATCH_PREFIX_MIN uncached tokens with a prefill
of this step waits one step and then finds them in the cache (SGLang deprioritises the same way).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

import torch

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.scheduler.batch import ScheduledBatch, ScheduledReq
from tessera.scheduler.req import Req
from tessera.scheduler.speculative import Speculator
from tessera.messages.worker import SlotWrite, TokenSlotWrites


IN_BATCH_PREFIX_MIN = 32  # shorter shared spans are cheaper to recompute than a step's wait


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


class SchedulePolicy:
    def __init__(self, kv: KVManager, max_running_requests: int, chunked_prefill_size: int, policy: str = "fcfs",
                 speculator: Speculator | None = None, max_prefill_tokens: int | None = None):
        self.kv = kv
        self.speculator = speculator  # drafts for decoding requests (scheduler/speculative.py); None: off
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens per step at most (None: no limit)
        self.policy = policy
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: hold a slot row and KV (mid-prefill or decoding)
        self.num_retractions = 0
        self.lora_slots = None  # with LoRA: what the adapter slots admit (scheduler/lora_slots.py LoraSlotTable)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        if self.speculator is not None:
            self.speculator.release(req.rid)
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _retract_one(self, scheduled: set[int]) -> bool:
        # Only requests not yet scheduled this step may go: a scheduled one holds fresh slots
        # whose KV the coming forward writes.
        candidates = [r for r in self.running if id(r) not in scheduled]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: r.arrival_time)
        self.running.remove(victim)
        self.kv.release(victim)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)
        return True

    def next_batch(self) -> ScheduledBatch | None:
        batch = ScheduledBatch()
        budget = self.chunked_prefill_size
        scheduled: set[int] = set()
        # 1. Decodes first, oldest first: a running request never starves behind new prefills. All of them in
        # one allocation when the free pages suffice; otherwise one by one, evicting and retracting.
        decoding = [r for r in sorted(self.running, key=lambda r: r.arrival_time) if r.is_prefill_done]
        if self.speculator is not None and decoding:
            decoding, budget = self._schedule_drafts(batch, decoding, budget, scheduled)
        slots = self.kv.alloc_decode(decoding) if decoding else None
        if slots is not None:
            for i, req in enumerate(decoding):
                batch.reqs.append(ScheduledReq(req, req.kv_len, req.kv_len + 1, slots[i:i + 1]))
            budget -= len(decoding)
            decoding = []
        for req in decoding:
            if req not in self.running:  # retracted for an older request's slot
                continue
            scheduled.add(id(req))
            slots = self.kv.alloc(req, 1)
            while slots is None and self._retract_one(scheduled):
                slots = self.kv.alloc(req, 1)
            if slots is None:
                continue  # waits a step; the requests ahead of it finish and free memory
            batch.reqs.append(ScheduledReq(req, req.kv_len, req.kv_len + 1, slots))
            budget -= 1
        # 2. Continue prefills in progress, then admit new requests; `prefill` counts their prompt tokens.
        prefill = 0
        for req in [r for r in self.running if not r.is_prefill_done]:
            room = min(budget, self._prefill_room(prefill))
            if room <= 0:
                break
            used = self._schedule_chunk(batch, req, room)
            budget, prefill = budget - used, prefill + used
        if self.policy == "lpm" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda r: -int(self.kv.tree.match_prefix(r.cache_key()).slots.numel())))
        # Keys of the prompts this step prefills whose KV the cache does not hold yet.
        inflight = [r.cache_key() for r in self.running if not r.is_prefill_done]
        deferred: list[Req] = []
        while budget > 0 and self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if self.lora_slots is not None and not self.lora_slots.fits(req, self.running):
                deferred.append(self.waiting.popleft())  # its adapter waits for a slot; others may go first
                continue
            if not self.kv.admit(req):
                break
            if self._shares_inflight_prefix(req, inflight):
                self.kv.release(req)
                if self.policy == "fcfs":
                    break  # nobody overtakes it
                deferred.append(self.waiting.popleft())
                continue
            if req.remaining_extend > self._prefill_room(prefill):
                self.kv.release(req)  # past this step's prompt tokens: it waits, and nobody overtakes it
                break
            used = self._schedule_chunk(batch, req, budget)
            if used == 0:
                self.kv.release(req)
                break
            self.kv.count_hit(req)
            self.waiting.popleft()
            self.running.append(req)
            budget, prefill = budget - used, prefill + used
            inflight.append(req.cache_key())
        self.waiting.extendleft(reversed(deferred))
        for s in batch.reqs:
            s.req.kv_len = s.end  # KV for these tokens is written by this step's forward
        return batch if batch.reqs else None

    def _prefill_room(self, prefill: int) -> int | float:
        """Prompt tokens the step may still take under max_prefill_tokens, after `prefill` of them; the first
        prefill of a step is not limited (a prompt longer than the limit runs alone)."""
        if self.max_prefill_tokens is None or prefill == 0:
            return float("inf")
        return self.max_prefill_tokens - prefill

    def _schedule_drafts(self, batch: ScheduledBatch, decoding: list[Req], budget: int,
                         scheduled: set[int]) -> tuple[list[Req], int]:
        """Verify steps for the decoding requests the speculator has drafts for: an extend of the last token
        and its drafts each. Returns the requests left to decode one token, and the budget left. A request
        whose slots do not fit decodes plainly (that path evicts and retracts)."""
        assert self.speculator is not None
        plain = []
        for req, draft in zip(decoding, self.speculator.drafts(decoding)):
            slots = self.kv.alloc(req, 1 + len(draft)) if draft and budget > len(draft) else None
            if slots is None:
                plain.append(req)
                continue
            scheduled.add(id(req))
            batch.reqs.append(ScheduledReq(req, req.kv_len, req.kv_len + 1 + len(draft), slots, draft))
            budget -= 1 + len(draft)
        return plain, budget

    def _shares_inflight_prefix(self, req: Req, inflight: list[list[int]]) -> bool:
        key = req.cache_key()
        # The shared span is at most the uncached rest of the prompt: a short one never waits, and the
        # scan over every in-flight prompt (quadratic in a step's admissions) is skipped.
        if self.kv.tree.disable or not inflight or len(key) - req.prefix_len < IN_BATCH_PREFIX_MIN:
            return False
        shared = max(len(os.path.commonprefix([key, other])) for other in inflight)
        return shared - req.prefix_len >= IN_BATCH_PREFIX_MIN

    def _schedule_chunk(self, batch: ScheduledBatch, req: Req, budget: int) -> int:
        n = min(req.remaining_extend, budget)
        end = req.kv_len + n
        for lo, hi in req.atomic_spans:  # never split a span that must be computed in one step
            if lo < end < hi:
                # Stop before it, or when the chunk starts at it, take it whole (over budget, or never progress).
                n = (lo if lo > req.kv_len else hi) - req.kv_len
                break
        slots = self.kv.alloc(req, n)
        if slots is None:
            return 0
        batch.reqs.append(ScheduledReq(req, req.kv_len, req.kv_len + n, slots))
        return n

    def finish(self, req: Req, allocated_len: int | None = None) -> None:
        if self.speculator is not None:
            self.speculator.release(req.rid)
        self.running.remove(req)
        self.kv.release(req, allocated_len)

    def finish_all(self, reqs: list[Req]) -> None:
        """finish() of each (none holds slots past its KV)."""
        if self.speculator is not None:
            for req in reqs:
                self.speculator.release(req.rid)
        gone = set(map(id, reqs))
        self.running = [r for r in self.running if id(r) not in gone]
        self.kv.release_all(reqs)
