"""Prefix caching for hybrid linear-attention models without a model (scheduler/state_snapshots.py): a fake
worker keeps each state slot as the tokens it has taken in and applies the steps' copies, resets and saves as the
worker does, and every chunk must start from exactly the tokens before it. Repeated prompts and a chat's next turn
resume from snapshots; snapshots are evicted (LRU, with their KV) and every slot comes back; verify steps roll the
state back to their last accepted draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tessera.cache.allocator import PagedTokenAllocator
from tessera.cache.kv_pool import ReqToTokenPool
from tessera.cache.radix_cache import RadixCache
from tessera.cache.state_pool import SnapshotSlots
from tessera.scheduler.kv_manager import KVManager
from tessera.scheduler.policy import SchedulePolicy
from tessera.scheduler.speculative import Speculator
from tests.scheduler.test_policy import assert_no_leak, make_req, run_to_completion

ROWS = 5  # request rows 0..4; snapshot slots follow


def make_hybrid_policy(pool_tokens: int = 512, page_size: int = 1, snapshots: int = 8, chunk: int = 16,
                       speculator: Speculator | None = None):
    alloc = PagedTokenAllocator(pool_tokens, page_size)
    tree = RadixCache(alloc, page_size, snapshots=SnapshotSlots(ROWS, snapshots))
    verify = SnapshotSlots(ROWS + snapshots, 3 * 2)  # k = 3 drafts for up to 2 verifying requests
    kv = KVManager(ReqToTokenPool(ROWS, 512), alloc, tree, page_size, verify_slots=verify)
    return SchedulePolicy(kv, ROWS - 1, chunk, speculator=speculator)


class FakeStates:
    """slot -> the tokens its state has taken in; the worker's copies, resets and saves in its order."""

    def __init__(self):
        self.slots: dict[int, tuple[int, ...]] = {}

    def step(self, policy: SchedulePolicy, batch) -> None:
        for src, dst in policy.kv.states.take_copies():  # type: ignore[union-attr]
            self.slots[dst] = self.slots[src]
        for s in batch.reqs:
            row, key = s.req.req_pool_idx, s.req.cache_key()
            tokens = key[:s.start + 1] + s.draft if s.draft else key[:s.end]  # a verify step: the last one, drafts
            if s.start == 0:
                self.slots[row] = ()
            assert self.slots[row] == tuple(key[:s.start]), f"{s.req.rid}: the state is not at token {s.start}"
            for n, slot in s.state_saves:
                self.slots[slot] = tuple(tokens[:s.start + n])
            self.slots[row] = tuple(tokens)


def run(policy: SchedulePolicy, states: FakeStates, reqs, abort_after: int | None = None) -> None:
    """test_policy.run_to_completion with the fake states; abort_after: the first request is aborted before that
    step."""
    def abort(i: int) -> None:
        if i == abort_after:
            policy.remove(reqs[0])
            reqs[0].finished_reason = {"type": "abort"}

    run_to_completion(policy, reqs, before_step=abort, on_batch=lambda batch: states.step(policy, batch))


def _hits(policy, states, prompt: list[int], max_new: int = 4):
    req = make_req(f"r{len(states.slots)}-{len(prompt)}", prompt, max_new)
    run(policy, states, [req])
    return req


@pytest.mark.parametrize("page_size", [1, 4])
def test_repeated_prompt_and_next_turn_resume_from_snapshots(page_size: int) -> None:
    policy, states = make_hybrid_policy(page_size=page_size), FakeStates()
    prompt = list(range(1, 42))  # 41 tokens: three 16-token chunks
    first = _hits(policy, states, prompt, max_new=7)
    assert first.cached_len == 0
    again = _hits(policy, states, prompt, max_new=7)  # the snapshot the prefill saved at its last whole page
    assert again.cached_len == 40 // page_size * page_size
    # The next turn: this prompt, its answer, more text; resumes where the last request's KV ended (47 tokens:
    # the last token never went through a forward), or with pages of 4 at the last page its decode completed.
    turn = prompt + again.output_ids + [7, 8, 9]
    second = _hits(policy, states, turn)
    assert second.cached_len == 47 // page_size * page_size
    assert policy.kv.tree.num_states() == policy.kv.tree.snapshots.num_used > 0  # type: ignore[union-attr]
    assert_no_leak(policy)
    assert policy.kv.tree.snapshots.num_used == 0  # type: ignore[union-attr]  # evicted with their KV


def test_snapshots_are_evicted_lru_and_a_prefix_without_one_is_computed() -> None:
    policy, states = make_hybrid_policy(snapshots=2), FakeStates()
    prompts = [[p] * 20 for p in (1, 2, 3)]
    for p in prompts:
        _hits(policy, states, p, max_new=1)
    snapshots = policy.kv.tree.snapshots
    assert snapshots is not None and snapshots.num_used == 2
    assert _hits(policy, states, prompts[2]).cached_len == 19  # the newest kept its snapshot
    assert _hits(policy, states, prompts[0]).cached_len == 0  # evicted: computed again, states still right
    assert snapshots.num_used == 2
    assert_no_leak(policy)
    assert snapshots.num_used == 0


def test_requests_sharing_the_first_chunks_resume_at_the_last_chunk_end_they_share() -> None:
    # Same image and system prompt (40 tokens), different questions, arriving together: the second waits for the
    # first's prefill (in-batch sharing), then resumes at the end of their last shared chunk (16-token chunks).
    policy, states = make_hybrid_policy(chunk=16), FakeStates()
    shared = list(range(1, 41))
    a, b = make_req("a", shared + [50] * 20, 2), make_req("b", shared + [60] * 20, 2)
    run(policy, states, [a, b])
    assert (a.cached_len, b.cached_len) == (0, 32)
    assert_no_leak(policy)


def test_abort_and_retraction_return_states_and_pages() -> None:
    # An abort in the middle of a prefill whose chunk saves a snapshot; a pool so small that requests retract.
    policy, states = make_hybrid_policy(pool_tokens=96, snapshots=3), FakeStates()
    reqs = [make_req(f"r{i}", [i + 1] * 30 + list(range(10)), 16) for i in range(3)]
    run(policy, states, reqs, abort_after=2)
    assert policy.num_retractions > 0
    assert_no_leak(policy)
    assert policy.kv.tree.snapshots.num_used == 0  # type: ignore[union-attr]
    assert torch.equal(policy.kv.allocator.free_page_ids().sort().values, torch.arange(96))


class _Guesses:
    """Drafts continuing the fake model's tokens (1000 + output length): every other call all three right, else
    the second wrong."""

    def __init__(self):
        self.calls = 0

    def propose(self, reqs, limits):
        self.calls += 1
        return [[1000 + len(r.output_ids) + i if self.calls % 2 or i != 1 else 7 for i in range(k)]
                for r, k in zip(reqs, limits)]

    def release(self, rid):
        pass


def test_verify_steps_roll_the_state_back_and_give_their_slots_back() -> None:
    """Speculative decoding: the fake model's next token is 1000 + the output length; drafts that are partly
    wrong leave the state after the last accepted one (the fake states check each step starts there), and the
    verify slots all come back."""
    from tessera.scheduler.scheduler import Scheduler

    spec = Speculator(_Guesses(), 3, disable_batch_size=3, context_length=400)
    policy, states = make_hybrid_policy(speculator=spec), FakeStates()
    scheduler = SimpleNamespace(speculator=spec, policy=policy)  # what Scheduler._verified reads
    reqs = [make_req(f"r{i}", [i + 1] * 20, 12) for i in range(2)]
    for r in reqs:
        policy.add(r)
    while (batch := policy.next_batch()) is not None:
        states.step(policy, batch)
        for s in batch.reqs:
            if s.is_prefill:
                policy.kv.cache_prefill(s.req)
        for s in [s for s in batch.reqs if s.samples]:
            sampled = [1000 + len(s.req.output_ids) + i for i in range(1 + len(s.draft))]
            for token in Scheduler._verified(scheduler, s, sampled) if s.draft else sampled:  # type: ignore[arg-type]
                s.req.output_ids.append(token)
                if len(s.req.output_ids) == 12:  # as Scheduler._finish: KV past the last token goes back too
                    held, s.req.kv_len = s.req.kv_len, min(s.req.kv_len, s.req.seq_len)
                    policy.finish(s.req, allocated_len=held)
                    s.req.finished_reason = {"type": "length"}
                    break
    assert [r.output_ids for r in reqs] == [list(range(1000, 1012))] * 2
    assert 0 < spec.num_accepted < spec.num_drafted
    assert policy.kv.states is not None and policy.kv.states.verify.num_used == 0  # type: ignore[union-attr]
    assert_no_leak(policy)
