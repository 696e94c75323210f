"""Speculative decoding without a model: what a verify step keeps, the n-gram proposer, the speculator's limits,
KV given back, and the acceptance rule's output distribution (statistically, on a small vocabulary)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.messages.sampling import SamplingParams
from tessera.scheduler.batch import ScheduledReq
from tessera.scheduler.req import Req
from tessera.scheduler.speculative import NgramProposer, Speculator, accepted_prefix
from tessera.worker.sampler import Sampler, SamplingBatchInfo
from tests.scheduler.test_policy import make_policy, make_req

IMG = 5
_RIDS = itertools.count()


def test_accepted_prefix_stops_at_the_first_row_that_disagrees():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3  # all kept, plus the bonus token
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1  # row 1 sampled 9: the step emits 4, 9
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_prefix([], [3]) == 0


def _req(prompt: list[int], output: list[int], media: list[tuple[int, int]] = (), max_new: int = 64) -> Req:
    mm = None
    if media:
        item = MultimodalDataItem(modality=Modality.IMAGE, hash=1, offsets=list(media), feature=torch.zeros(1))
        mm = MultimodalInputs(items=[item])
    req = Req(f"r{next(_RIDS)}", prompt, SamplingParams(max_new_tokens=max_new), mm)
    req.output_ids = list(output)
    return req


def test_ngram_proposes_the_latest_longest_match():
    ngram = NgramProposer(1, 4)
    # "1 2 3" is followed by 4 early on and by 8 later: the later occurrence wins; the 3-gram beats the 1-gram.
    req = _req([1, 2, 3, 4, 9, 1, 2, 3, 8, 8, 7, 3, 6], [1, 2, 3])
    assert ngram.propose([req], [3]) == [[8, 8, 7]]
    assert ngram.propose([req], [1]) == [[8]]
    req.output_ids += [8, 8]  # the index follows the output incrementally
    assert ngram.propose([req], [4]) == [[7, 3, 6, 1]]
    assert ngram.propose([_req([1, 2], [9])], [4]) == [[]]  # nothing to match
    # A repeating pattern: the match's continuation runs into the suffix and goes on repeating it.
    assert ngram.propose([_req([3, 1, 2, 1, 2], [1, 2])], [5]) == [[1, 2, 1, 2, 1]]


def test_ngram_never_matches_media_placeholders():
    ngram = NgramProposer(1, 3)
    # The earlier "7 8" runs into the image: no draft from it; the later one continues with 9.
    assert ngram.propose([_req([7, 8, IMG, IMG, IMG, 7, 8, 9, 1], [7, 8], media=[(2, 5)])], [3]) == [[9, 1, 7]]
    assert ngram.propose([_req([7, 8, IMG, IMG, IMG, 1], [7, 8], media=[(2, 5)])], [3]) == [[]]
    # A generated token equal to the placeholder id finds nothing in the image's span.
    assert ngram.propose([_req([1, IMG, IMG, IMG, IMG, 2], [3, IMG], media=[(1, 5)])], [2]) == [[]]


class _Fixed:
    def __init__(self, draft):
        self.draft, self.limits, self.released = draft, None, []

    def propose(self, reqs, limits):
        self.limits = list(limits)
        return [list(self.draft) for _ in reqs]

    def release(self, rid):
        self.released.append(rid)


class _Grammar:
    def valid_prefix(self, tokens):
        return 2 if len(tokens) > 2 else len(tokens)


def test_speculator_limits_drafts():
    prop = _Fixed([4, 5, 6, 7])
    spec = Speculator(prop, 4, disable_batch_size=3, context_length=100)
    near_end = _req([1] * 10, [2] * 8, max_new=10)  # two tokens left: one draft plus the step's own token
    long_ctx = _req([1] * 96, [2])  # 97 tokens of 100: two more fit
    opted_out = _req([1], [2])
    opted_out.sampling_params.speculative = False
    drafts = spec.drafts([near_end, long_ctx])
    assert prop.limits == [1, 2] and drafts == [[4], [4, 5]]
    assert spec.drafts([opted_out]) == [[]]
    assert spec.drafts([near_end, long_ctx, opted_out]) == [[], [], []]  # the batch reached the disable size
    constrained = _req([1], [2])
    constrained.grammar = _Grammar()
    assert spec.drafts([constrained]) == [[4, 5]]  # cut where the grammar stops accepting


@pytest.mark.parametrize("page_size", [1, 4])
def test_truncate_gives_back_rejected_slots(page_size):
    policy = make_policy(64, page_size=page_size, disable_cache=True)
    kv = policy.kv
    total = kv.allocator.num_free_tokens
    req = make_req("a", list(range(10)), 8)
    assert kv.admit(req)
    kv.alloc(req, 10)
    req.kv_len = 10
    free_before = kv.allocator.num_free_tokens
    slots = kv.alloc(req, 5)  # a verify step of 5 tokens
    req.kv_len = 15
    kv.truncate(req, 12)  # two drafts accepted: tokens 12..14 rejected
    assert req.kv_len == 12
    kept = kv.req_pool.req_to_token[req.req_pool_idx, 10:12]
    assert torch.equal(kept, slots[:2])
    # Pages of 4: tokens 0..11 fill three pages whole, so the page of 12..14 goes back; pages of 1: 3 slots.
    assert kv.allocator.num_free_tokens == free_before - (2 if page_size == 1 else 0)
    nxt = kv.alloc(req, 1)  # the next token continues right after the kept ones
    if page_size == 4:
        assert int(nxt[0]) % 4 == 1  # a fresh page (12 % 4 == 0)
    req.kv_len = 13
    kv.release(req)
    assert kv.allocator.num_free_tokens == total


def test_truncate_inside_a_page_keeps_the_page():
    policy = make_policy(64, page_size=4, disable_cache=True)
    kv = policy.kv
    total = kv.allocator.num_free_tokens
    req = make_req("a", list(range(6)), 8)
    assert kv.admit(req)
    kv.alloc(req, 6)
    req.kv_len = 6
    slots = kv.alloc(req, 5)  # tokens 6..10: the rest of page 2 and page 3
    req.kv_len = 11
    free_before = kv.allocator.num_free_tokens
    kv.truncate(req, 7)  # token 6 kept: page 2 stays, page 3 goes
    assert kv.allocator.num_free_tokens == free_before + 4
    nxt = kv.alloc(req, 1)
    assert int(nxt[0]) == int(slots[1])  # token 7 takes the next slot of the kept page
    req.kv_len = 8
    kv.release(req)
    assert kv.allocator.num_free_tokens == total


def test_verify_rule_keeps_the_target_distribution():
    """Rows sampled by the real sampler (temperature, top-k), drafts checked by accepted_prefix: the first token
    follows row 0's distribution, and the second, given the draft was accepted, row 1's, whatever the draft."""
    vocab, n, draft = 6, 40_000, [2, 4]
    logits = torch.tensor([[1.0, 0.2, 1.4, -0.5, 0.7, 0.1], [0.3, 1.1, -0.2, 0.9, 1.6, 0.0],
                           [0.5, 0.5, 0.0, 1.2, -1.0, 0.8]])
    params = [SamplingParams(temperature=0.8, top_k=5).normalize() for _ in range(3 * n)]
    info = SamplingBatchInfo.build(params, vocab, [[]] * (3 * n), [[]] * (3 * n))
    sampled = Sampler(seed=3)(logits.repeat(n, 1), info).next_token_ids.view(n, 3).tolist()
    emitted = [rows[:accepted_prefix(draft, rows) + 1] for rows in sampled]

    def target(row):
        p = torch.softmax(logits[row] / 0.8, -1)
        p[p.argsort()[0]] = 0  # top-k 5 of 6 drops the least likely
        return p / p.sum()

    def chi2(tokens, p):
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
        expected = p * len(tokens)
        keep = expected > 0
        assert counts[~keep].sum() == 0  # nothing outside the filtered support
        return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())

    first = [e[0] for e in emitted]
    second = [e[1] for e in emitted if len(e) > 1]
    assert len(second) == pytest.approx(n * float(target(0)[draft[0]]), rel=0.05)  # accepted with p(d)
    # 4 degrees of freedom (5 tokens kept): 18.5 is the 0.1% critical value.
    assert chi2(first, target(0)) < 18.5
    assert chi2(second, target(1)) < 18.5


def test_scheduled_verify_rows_sample_after_their_drafts():
    req = _req([1, 2, 3], [7])
    s = ScheduledReq(req, 3, 6, torch.tensor([4, 5, 6]), draft=[8, 9])
    assert s.samples and not s.is_prefill


def test_drafts_that_keep_missing_back_off():
    spec = Speculator(_Fixed([4, 5]), 2, disable_batch_size=8, context_length=100)
    req = _req([1], [2])
    tried = []
    for _ in range(12):
        drafted = spec.drafts([req])[0]
        tried.append(bool(drafted))
        if drafted:
            spec.record(req.rid, len(drafted), 0)  # every draft rejected
    # Tries, then waits of 1, 2, 4 steps between them.
    assert tried == [True, False, True, False, False, True, False, False, False, False, True, False]
    spec.drafts([req]), spec.drafts([req])  # the wait of 8 runs out after the 8th step
    for _ in range(6):
        spec.drafts([req])
    assert spec.drafts([req])[0]
    spec.record(req.rid, 2, 1)  # an accepted draft: the next miss waits one step again, not 16
    spec.record(req.rid, 2, 0)
    assert spec.drafts([req]) == [[]] and spec.drafts([req])[0]


def test_oracle_picks_the_recorded_answer_that_agrees_with_the_output(tmp_path):
    """Two prompts with equal ids (one question about two images: the placeholders are one id) keep both
    answers; the one the output so far agrees with is proposed."""
    import json

    from tessera.scheduler.speculative import OracleProposer

    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([{"input_ids": [1, 2], "output_ids": [7, 8, 9, 10]},
                                {"input_ids": [1, 2], "output_ids": [7, 3, 4, 5]},
                                {"input_ids": [6], "output_ids": [11, 12]}]))
    oracle = OracleProposer(str(path))
    assert oracle.propose([_req([1, 2], [7])], [2]) == [[8, 9]]  # a tie: the first recorded
    assert oracle.propose([_req([1, 2], [7, 3])], [2]) == [[4, 5]]
    assert oracle.propose([_req([1, 2], [7, 3, 4]), _req([6], [11]), _req([9], [])], [4, 4, 4]) == [[5], [12], []]
