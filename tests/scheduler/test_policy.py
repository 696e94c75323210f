"""Scheduler policy without a model: chunking, admission, retraction and leak-freedom."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.messages.finish import FinishReason
from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.messages.sampling import SamplingParams
from tessera.scheduler.kv_manager import KVManager
from tessera.scheduler.policy import SchedulePolicy
from tessera.scheduler.req import Req


def make_policy(pool_tokens: int, page_size: int = 1, chunk: int = 16, max_running: int = 8,
                disable_cache: bool = False, extra_slots: int = 0, max_prefill: int | None = None) -> SchedulePolicy:
    alloc = PagedTokenAllocator(pool_tokens, page_size)
    tree = RadixCache(alloc, page_size, disable=disable_cache)
    kv = KVManager(ReqToTokenPool(max_running + 1, 512), alloc, tree, page_size,
                   (lambda req: extra_slots) if extra_slots else None)
    return SchedulePolicy(kv, max_running, chunk, max_prefill_tokens=max_prefill)


def make_req(rid: str, prompt: list[int], max_new: int) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new), None)


def run_to_completion(policy: SchedulePolicy, reqs: list[Req], max_steps: int = 10_000) -> list[list[tuple[int, int]]]:
    """Fake forward: each sampling request gets token (1000 + its output length); prefill chunks are shared
    through the radix cache right after their step, as the scheduler does. Returns per-step chunks."""
    for r in reqs:
        policy.add(r)
    steps = []
    for _ in range(max_steps):
        batch = policy.next_batch()
        if batch is None:
            break
        steps.append([(s.start, s.end) for s in batch.reqs])
        assert batch.num_tokens <= policy.chunked_prefill_size + len(policy.running)
        # Slots of one step are distinct and all hold a req_to_token entry.
        locs = torch.cat([s.out_cache_loc for s in batch.reqs])
        assert len(set(locs.tolist())) == len(locs)
        for s in batch.reqs:
            row = policy.kv.req_pool.req_to_token[s.req.req_pool_idx]
            assert torch.equal(row[s.start : s.end], s.out_cache_loc)
        for s in batch.reqs:
            if s.end - s.start > 1 or not s.req.output_ids:  # as the scheduler: prefill chunks go to the cache
                policy.kv.cache_prefill(s.req)
        for s in batch.reqs:
            if s.samples:
                s.req.output_ids.append(1000 + len(s.req.output_ids))
                if len(s.req.output_ids) >= s.req.sampling_params.max_new_tokens:
                    policy.finish(s.req)
                    s.req.finished_reason = FinishReason.of_length(0)
    assert all(r.finished for r in reqs), "not every request finished"
    return steps


def assert_no_leak(policy: SchedulePolicy) -> None:
    tree, alloc = policy.kv.tree, policy.kv.allocator
    assert tree.protected_size() == 0
    tree.evict(alloc.size)
    assert alloc.num_free_pages == alloc.num_pages
    assert policy.kv.req_pool.num_free == len(policy.kv.req_pool.req_to_token)


def test_chunked_prefill_respects_budget() -> None:
    policy = make_policy(pool_tokens=512, chunk=16)
    req = make_req("a", list(range(1, 51)), max_new=3)
    steps = run_to_completion(policy, [req])
    assert steps[:4] == [[(0, 16)], [(16, 32)], [(32, 48)], [(48, 50)]]
    assert steps[4:] == [[(50, 51)], [(51, 52)]]
    assert req.output_ids == [1000, 1001, 1002]
    assert_no_leak(policy)


@pytest.mark.parametrize("max_prefill", [None, 25])
def test_max_prefill_tokens_limits_the_prompt_tokens_a_step_admits(max_prefill: int | None) -> None:
    """SGLang's --max-prefill-tokens: four 10-token prompts fit one step's chunk budget (64), but with a limit
    of 25 a step takes two of them (a third would make 30); a 50-token prompt still runs whole, alone (the
    chunked-prefill size cuts it, not the limit). The outputs are the same."""
    policy = make_policy(pool_tokens=512, chunk=64, max_prefill=max_prefill)
    reqs = [make_req(f"r{i}", [100 + i] * 10, max_new=3) for i in range(4)]
    steps = run_to_completion(policy, reqs)
    prefill_per_step = [sum(e - s for s, e in step if e - s > 1) for step in steps]
    assert prefill_per_step[:2] == ([40, 0] if max_prefill is None else [20, 20])
    assert [r.output_ids for r in reqs] == [[1000, 1001, 1002]] * 4
    policy = make_policy(pool_tokens=512, chunk=64, max_prefill=max_prefill)
    long, short = make_req("long", list(range(1, 51)), max_new=1), make_req("short", [7] * 10, max_new=1)
    steps = run_to_completion(policy, [long, short])
    assert steps[0] == ([(0, 50), (0, 10)] if max_prefill is None else [(0, 50)])
    assert long.output_ids == short.output_ids == [1000]
    assert_no_leak(policy)


def test_decodes_join_prefills_in_one_step() -> None:
    policy = make_policy(pool_tokens=512, chunk=8)
    a, b = make_req("a", [1, 2, 3], 4), make_req("b", list(range(10, 30)), 2)
    policy.add(a)
    first = policy.next_batch()
    assert [(s.start, s.end) for s in first.reqs] == [(0, 3)]
    a.output_ids.append(7)
    policy.add(b)
    second = policy.next_batch()
    # a decodes (1 token) while b prefills with the remaining 7 of the budget.
    assert [(s.req.rid, s.start, s.end) for s in second.reqs] == [("a", 3, 4), ("b", 0, 7)]


def test_prefix_cache_reuse_between_requests() -> None:
    policy = make_policy(pool_tokens=512, chunk=64)
    shared = list(range(1, 41))
    a = make_req("a", shared + [50, 51], 2)
    run_to_completion(policy, [a])
    b = make_req("b", shared + [60, 61, 62], 2)
    run_to_completion(policy, [b])
    assert b.cached_len == 40
    assert_no_leak(policy)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_when_pool_runs_out_loses_nothing(page_size: int) -> None:
    # Four requests that each fit alone but not together: someone must be retracted.
    policy = make_policy(pool_tokens=96, page_size=page_size, chunk=64, max_running=4)
    reqs = [make_req(f"r{i}", [100 + i] * 10, max_new=30) for i in range(4)]
    run_to_completion(policy, reqs)
    assert policy.num_retractions > 0
    for r in reqs:  # outputs are complete and in order despite retraction
        assert r.output_ids == [1000 + k for k in range(30)]
    assert_no_leak(policy)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cross_attention_slots_are_taken_at_admission_and_freed_on_retraction(page_size: int) -> None:
    """Encoder-decoder requests hold 40 cross-attention slots each: three fit the pool at admission, but not
    with their growing decoder K/V, so the newest is retracted (its cross slots freed and refilled later)."""
    policy = make_policy(pool_tokens=160, page_size=page_size, chunk=64, max_running=4, disable_cache=True,
                         extra_slots=40)
    reqs = [make_req(f"r{i}", [100 + i] * 4, max_new=12) for i in range(4)]
    for r in reqs:
        policy.add(r)
    fills = {r.rid: 0 for r in reqs}
    while (batch := policy.next_batch()) is not None:
        running = [r for r in policy.running if r.state_slots is not None]
        assert len(running) == len(policy.running) <= 3  # a fourth's 40 slots do not fit
        held = [r.state_slots for r in running] + [policy.kv.req_pool.req_to_token[r.req_pool_idx, :r.kv_len]
                                                   for r in running]
        flat = torch.cat(held).tolist()
        assert len(flat) == len(set(flat)), "cross and decoder slots never overlap"
        assert policy.kv.state_tokens == 40 * len(running)
        for s in batch.reqs:
            if not s.req.state_filled:  # what build_forward_input does with a RequestStateFill
                fills[s.req.rid] += 1
                s.req.state_filled = True
            if s.samples:
                s.req.output_ids.append(1000 + len(s.req.output_ids))
                if len(s.req.output_ids) >= 12:
                    policy.finish(s.req)
                    s.req.finished_reason = FinishReason.of_length(0)
    assert all(r.finished for r in reqs) and policy.num_retractions > 0
    assert sum(fills.values()) == len(reqs) + policy.num_retractions  # refilled once per re-admission
    assert policy.kv.state_tokens == 0 and all(r.state_slots is None for r in reqs)
    assert_no_leak(policy)


def test_random_workload_never_leaks() -> None:
    rng = random.Random(0)
    for page_size, disable in ((1, False), (2, False), (4, True)):
        policy = make_policy(pool_tokens=160, page_size=page_size, chunk=24, max_running=5, disable_cache=disable)
        prefixes = [[rng.randint(1, 50) for _ in range(rng.randint(1, 20))] for _ in range(3)]
        reqs = [make_req(str(i), rng.choice(prefixes) + [rng.randint(1, 50) for _ in range(rng.randint(1, 20))],
                         rng.randint(1, 25)) for i in range(20)]
        run_to_completion(policy, reqs)
        assert_no_leak(policy)


def test_failed_step_returns_fresh_slots() -> None:
    for page_size in (1, 4):
        policy = make_policy(pool_tokens=256, page_size=page_size, chunk=8)
        req = make_req("a", list(range(1, 21)), 5)
        policy.add(req)
        policy.next_batch()  # first chunk [0, 8) "succeeds"
        batch = policy.next_batch()  # second chunk [8, 16) "fails"
        (s,) = batch.reqs
        req.kv_len = s.start
        policy.finish(req, allocated_len=s.end)
        assert_no_leak(policy)


@pytest.mark.parametrize("policy_name", ["fcfs", "lpm"])
def test_requests_arriving_together_compute_a_shared_prefix_once(policy_name: str) -> None:
    """Three requests with one 40-token system prompt in the same step: the first computes it, the others
    wait one step and find it cached (without this, all three would prefill it side by side)."""
    policy = make_policy(pool_tokens=512, chunk=256)
    policy.policy = policy_name
    shared = list(range(1, 41))
    reqs = [make_req(f"r{i}", shared + [100 + i, 200 + i], 2) for i in range(3)]
    other = make_req("other", list(range(300, 320)), 2)  # shares nothing: never held back by lpm
    steps = run_to_completion(policy, reqs + [other])
    if policy_name == "fcfs":
        assert steps[0] == [(0, 42)]  # r0 alone: under fcfs nobody overtakes r1
    else:
        assert sorted(steps[0]) == [(0, 20), (0, 42)]
    assert [r.cached_len for r in reqs] == [0, 40, 40]
    assert policy.kv.prefix_hit_tokens == 80  # counted once per request, not per deferral
    assert policy.kv.prefix_total_tokens == 3 * 42 + 20
    assert_no_leak(policy)


def test_short_shared_spans_do_not_hold_requests_back() -> None:
    policy = make_policy(pool_tokens=512, chunk=256)
    reqs = [make_req(f"r{i}", [1, 2, 3, 4] + [100 + i] * 10, 2) for i in range(3)]
    steps = run_to_completion(policy, reqs)
    assert len(steps[0]) == 3


def test_disabled_cache_never_defers() -> None:
    policy = make_policy(pool_tokens=512, chunk=256, disable_cache=True)
    reqs = [make_req(f"r{i}", list(range(1, 41)) + [100 + i], 2) for i in range(3)]
    steps = run_to_completion(policy, reqs)
    assert len(steps[0]) == 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_salt_isolates_prefix_entries(page_size: int) -> None:
    policy = make_policy(pool_tokens=512, page_size=page_size, chunk=64)
    shared = list(range(1, 41))

    def cached(rid: str, salt: str | None) -> int:
        req = Req(rid, shared + [50 + len(rid)], SamplingParams(max_new_tokens=2), None, cache_salt=salt)
        run_to_completion(policy, [req])
        return req.cached_len

    assert cached("a", "alice") == 0
    assert cached("bb", None) == 0  # unsalted requests never see a salted entry
    assert cached("ccc", "bob") == 0
    assert cached("dddd", "alice") == cached("eeeee", None) == cached("ffffff", "bob") == 40
    assert_no_leak(policy)


@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_decode_allocation_equals_one_request_at_a_time(page_size: int) -> None:
    """alloc_decode (the whole batch's decode slots at once) gives every request the slot alloc(req, 1) would:
    the next slot of its own last page, or the first of a new page when that page is full; and when the
    free pages do not cover the batch it takes nothing."""
    def prefilled(policy: SchedulePolicy, lens: list[int]) -> list[Req]:
        reqs = [make_req(f"r{i}", [100 * i + t for t in range(n)], 8) for i, n in enumerate(lens)]
        for r in reqs:
            assert policy.kv.admit(r)
            assert policy.kv.alloc(r, len(r.origin_input_ids)) is not None
            r.kv_len = len(r.origin_input_ids)
        return reqs

    lens = [1, 3, 4, 5, 8, 9]  # with pages of 4: ends inside a page, at its last slot, and right after it
    one, batched = make_policy(256, page_size), make_policy(256, page_size)
    reqs_one, reqs_batched = prefilled(one, lens), prefilled(batched, lens)
    one.kv.take_pending(), batched.kv.take_pending()
    want = torch.cat([one.kv.alloc(r, 1) for r in reqs_one])
    got = batched.kv.alloc_decode(reqs_batched)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(batched.kv.req_pool.req_to_token, one.kv.req_pool.req_to_token)
    assert batched.kv.allocator.num_free_pages == one.kv.allocator.num_free_pages
    (write,), _ = batched.kv.take_pending()  # one journal entry for the batch, naming each request's entry
    rows, cols = write.positions()
    assert rows.tolist() == [r.req_pool_idx for r in reqs_batched] and cols.tolist() == lens
    assert torch.equal(write.slots, want)

    # Not enough free pages for every request that needs one: nothing is taken, nothing is written.
    full = make_policy(3 * page_size, page_size)
    reqs = prefilled(full, [page_size, page_size])  # two requests, each needing a new page; one page left
    table, free = full.kv.req_pool.req_to_token.clone(), full.kv.allocator.num_free_pages
    full.kv.take_pending()
    assert full.kv.alloc_decode(reqs) is None
    assert torch.equal(full.kv.req_pool.req_to_token, table) and full.kv.allocator.num_free_pages == free
    assert full.kv.take_pending()[0] == []


def test_finish_all_releases_as_finishing_one_by_one():
    """A step's embedding requests are released together (one allocator call): the tree, the free pages and
    the slot rows end as when each finishes alone."""
    states = []
    for together in (False, True):
        policy = make_policy(256, page_size=2, chunk=64)
        reqs = [make_req(f"r{i}", [1, 2, 3, 4, 10 + i, 20 + i, 30], 1) for i in range(5)]
        for r in reqs:
            policy.add(r)
        batch = policy.next_batch()
        assert batch is not None and len(batch.reqs) == 5
        if together:
            policy.finish_all(reqs)
        else:
            for r in reqs:
                policy.finish(r)
        kv = policy.kv
        states.append((kv.allocator.num_free_pages, kv.tree.total_size(), sorted(kv.allocator.free_page_ids().tolist()),
                       kv.req_pool.available_size() if hasattr(kv.req_pool, "available_size") else None))
        assert not policy.running
    assert states[0] == states[1]
