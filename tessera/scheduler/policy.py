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

from tessera.scheduler.batch import ScheduledBatch, ScheduledReq
from tessera.scheduler.kv_manager import KVManager
from tessera.scheduler.req import Req
from tessera.scheduler.speculative import Speculator


IN_BATCH_PREFIX_MIN = 32  # shorter shared spans are cheaper to recompute than a step's wait


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
