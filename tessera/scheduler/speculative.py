"""Speculative decoding, the scheduler's half: proposals, and what a verify step keeps.

A decoding request with drafts d1..dk is scheduled as an extend of k + 1 tokens, [its last token, d1..dk],
over its paged KV (scheduler/policy.py); the worker scores all k + 1 rows in one forward and samples each row
as a plain decode step would have sampled it after the drafts before it (scheduler/step_input.py gives row i
the output so far plus d1..di: penalties, min_new_tokens, the grammar's mask and a seeded row's per-step seed
all see what they would have seen). `accepted_prefix` keeps the sampled tokens up to the first row whose token
differs from the draft it checks, so the output is the one decoding without drafts gives: token-identical for
greedy (and seeded) rows. For sampled rows this is the speculative sampling rule with a deterministic proposer
(q is one-hot on the draft): d is accepted with probability min(1, p(d) / q(d)) = p(d), and on rejection the
token comes from p without d, renormalised (max(0, p - q)), which is exactly what the row's sample is given
that it differs from d. The KV slots of the rejected drafts go back (KVManager.truncate).

Proposers: NGRAM (prompt lookup: the continuation of the latest earlier occurrence of the output's last n
tokens in the request's own prompt and output; media placeholders never match), ORACLE (benchmarks only: the
recorded greedy answer, the ceiling the real proposers approach) and STANDALONE (a draft model, run by the
worker: worker/draft_model.py, reached through the scheduler's StepWorker.propose).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from tessera.config import ServerArgs
from tessera.scheduler.req import Req


class Proposer(Protocol):
    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens continuing reqs[i].fill_ids (fewer, or none, when it has no guess)."""
        ...

    def release(self, rid: str) -> None:
        """The request left: drop what was kept for it."""
        ...


def accepted_prefix(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts the verify step accepted: sampled[i] is row i's token (row 0 follows the last real token,
    row i follows draft i), and draft i + 1 stands while it equals sampled[i]. The step then emits
    sampled[:accepted + 1]."""
    n = 0
    while n < len(draft) and n < len(sampled) and sampled[n] == draft[n]:  # any two sequences: their common prefix
        n += 1
    return n


class _NgramIndex:
    """One request's n-grams (n in [lo, hi]) -> where the token after their latest occurrence sits. An n-gram is
    entered when the token after it arrives, so the sequence's own suffix only matches an earlier occurrence."""

    def __init__(self, lo: int, hi: int, media: bytearray):
        self.lo, self.hi = lo, hi
        self.media = media  # 1 at prompt positions holding media placeholders
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}

    def _is_media(self, p: int) -> bool:
        return p < len(self.media) and self.media[p] == 1

    def sync(self, fill_ids: Sequence[int]) -> None:
        for p in range(len(self.tokens), len(fill_ids)):
            self.tokens.append(fill_ids[p])
            if self._is_media(p):
                continue
            for n in range(1, min(self.hi, p) + 1):
                if self._is_media(p - n):
                    break  # longer n-grams reach further back over it too
                if n >= self.lo:
                    self.after[tuple(self.tokens[p - n:p])] = p

    def lookup(self, k: int) -> list[int]:
        end = len(self.tokens)
        for n in range(min(self.hi, end), self.lo - 1, -1):
            at = self.after.get(tuple(self.tokens[end - n:]))
            if at is None:
                continue
            draft: list[int] = []
            for p in range(at, at + k):
                if p >= end:  # the match runs into the suffix itself (a repeating pattern): it continues it
                    draft.append(draft[p - end])
                elif self._is_media(p):
                    break
                else:
                    draft.append(self.tokens[p])
            if draft:
                return draft
        return []


class NgramProposer:
    """Prompt lookup (SGLang's NGRAM, vLLM's `ngram`): no model, a per-request index of its own tokens."""

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, limits):
            index = self._index.get(req.rid)
            if index is None:
                index = self._index[req.rid] = _NgramIndex(self.min_window, self.max_window, _media_mask(req))
            index.sync(req.fill_ids)
            out.append(index.lookup(k) if k > 0 else [])
        return out

    def release(self, rid: str) -> None:
        self._index.pop(rid, None)


def _media_mask(req: Req) -> bytearray:
    mask = bytearray(len(req.origin_input_ids))
    for item in req.mm_inputs.items if req.mm_inputs is not None else ():
        for lo, hi in item.offsets:
            mask[lo:hi] = b"\x01" * (hi - lo)
    return mask


class OracleProposer:
    """Benchmarks only: proposes the greedy answer recorded for the same prompt (a JSON list of
    {"input_ids": [...], "output_ids": [...]}). What a perfect proposer would give: the verify mechanism's own
    ceiling (tests record wrong tokens on purpose, to make verify steps reject). Prompts whose ids are equal
    (the same question about different images: placeholders are one id) may hold several answers: the one that
    agrees longest with the output so far is proposed."""

    def __init__(self, path: str):
        self.answers: dict[tuple[int, ...], list[list[int]]] = {}
        with open(path) as f:
            for r in json.load(f):
                self.answers.setdefault(tuple(r["input_ids"]), []).append(list(r["output_ids"]))

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, limits):
            # By position, whatever the output so far: recorded tokens that are wrong are simply rejected.
            done = len(req.output_ids)
            answers = self.answers.get(tuple(req.origin_input_ids), [[]])
            best = max(answers, key=lambda answer: accepted_prefix(answer, req.output_ids))
            out.append(best[done:done + k])
        return out

    def release(self, rid: str) -> None:
        pass


MAX_BACKOFF = 16


class Speculator:
    """Decides which decoding requests get drafts this step and how many, and counts what verify steps kept
    (acceptance length and rate for /metrics and get_server_info)."""

    def __init__(self, proposer: Proposer, num_draft: int, disable_batch_size: int, context_length: int):
        self.proposer = proposer
        self.num_draft = num_draft
        self.disable_batch_size = disable_batch_size
        self.context_length = context_length
        self.num_verifies = 0  # request-steps that verified drafts
        self.num_drafted = 0
        self.num_accepted = 0
        # A request whose drafts keep missing pays a verify step (k + 1 rows, off the plain decode path) for one
        # token: after m misses in a row it decodes 2^(m-1) steps (at most MAX_BACKOFF) before the next try.
        self._misses: dict[str, int] = {}
        self._wait: dict[str, int] = {}

    def drafts(self, reqs: Sequence[Req]) -> list[list[int]]:
        """Per request, the drafts to verify this step ([] for none). None at all once the decoding batch reaches
        the disable size: there a step computes rather than reads weights, and rejected rows cost time."""
        if len(reqs) >= self.disable_batch_size:
            return [[] for _ in reqs]
        limits = []
        for req in reqs:
            sp = req.sampling_params
            # No draft past what the request may still emit (the verify step emits accepted + 1) or its context.
            room = min(sp.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
            wait = self._wait.get(req.rid, 0)
            if wait:
                self._wait[req.rid] = wait - 1
            limits.append(min(self.num_draft, room) if sp.speculative and not wait else 0)
        proposals = self.proposer.propose(reqs, limits) if any(limits) else [[] for _ in reqs]
        out = []
        for req, draft, k in zip(reqs, proposals, limits):
            draft = list(draft[:max(k, 0)])
            if draft and req.grammar is not None:  # every draft row must be one the grammar allows
                draft = draft[:req.grammar.valid_prefix(draft)]
            out.append(draft)
        return out

    def record(self, rid: str, drafted: int, accepted: int) -> None:
        self.num_verifies += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        if accepted:
            self._misses.pop(rid, None)
        else:
            misses = self._misses[rid] = self._misses.get(rid, 0) + 1
            self._wait[rid] = min(2 ** (misses - 1), MAX_BACKOFF)

    def release(self, rid: str) -> None:
        self.proposer.release(rid)
        self._misses.pop(rid, None)
        self._wait.pop(rid, None)


def make_speculator(args: ServerArgs, context_length: int, draft: Proposer | None = None) -> Speculator | None:
    """The server's speculator, or None without --speculative-algorithm. draft: STANDALONE's proposer (the
    worker's draft model, worker/draft_model.py)."""
    k = args.speculative_num_draft
    if k == 0:
        return None
    algo = args.speculative_algorithm
    if algo == "NGRAM":
        proposer: Proposer = NgramProposer(args.speculative_ngram_min_match_window_size,
                                           args.speculative_ngram_max_match_window_size)
    elif algo == "ORACLE":
        proposer = OracleProposer(args.speculative_oracle_path)  # type: ignore[arg-type]
    else:
        if draft is None:
            raise ValueError(f"speculative_algorithm: {algo} needs a draft model this worker does not have")
        proposer = draft
    return Speculator(proposer, k, args.speculative_disable_by_batch_size, context_length)
