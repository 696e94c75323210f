"""STANDALONE's draft model (worker/draft_model.py): its feeds of a few tokens go through the CPU decode stack as
decode rows (layers/decode_stack.run_rows) and propose what the general path (an extend through the attention
backend) proposes, over requests that come, advance by what a verify step kept, and go."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from tessera.config import ServerArgs
from tessera.layers import decode_stack
from tessera.worker import draft_model
from tessera.worker.draft_model import DraftModel


def _run(monkeypatch, fast: bool) -> tuple[list[list[list[int]]], int]:
    """The drafts of three requests over 40 verify cycles, and how many forwards took the decode stack."""
    monkeypatch.setattr(draft_model, "FAST_ROWS", 16 if fast else 0)
    calls = [0]
    run_rows = decode_stack.run_rows

    def counted(*args, **kwargs):
        out = run_rows(*args, **kwargs)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(decode_stack, "run_rows", counted)
    args = ServerArgs(model_path="demo-vl", speculative_algorithm="STANDALONE",
                      speculative_draft_model_path="demo-vl-draft")
    draft = DraftModel(args, torch.device("cpu"), 512, 549, rows=2)
    rng = random.Random(3)
    reqs = [SimpleNamespace(rid=f"r{i}", fill_ids=[rng.randrange(20, 549) for _ in range(9 + 5 * i)])
            for i in range(3)]
    out = []
    for cycle in range(40):
        live = [r for r in reqs if len(r.fill_ids) < 200]
        drafts = draft.propose(live, [4, 3, 2][:len(live)])
        out.append(drafts)
        for req, d in zip(live, drafts):  # a verify step keeps some drafts and adds its own token
            kept = d[:rng.randrange(len(d) + 1)]
            req.fill_ids = req.fill_ids + kept + [rng.randrange(20, 549)]
        if cycle == 20:
            draft.release("r1")  # gone: its row goes to another, and r1 comes back with a fresh prefix
    return out, calls[0]


def test_decode_rows_propose_what_the_general_path_proposes(monkeypatch) -> None:
    fast, fast_calls = _run(monkeypatch, True)
    slow, slow_calls = _run(monkeypatch, False)
    assert slow_calls == 0 and fast_calls > 100
    assert fast == slow
    assert sum(len(d) for step in fast for d in step) > 200  # drafts were made, not empty lists
