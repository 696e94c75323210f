"""STANDALONE speculative decoding's draft model: a small checkpoint with the target's tokenizer, run greedily for
k steps per verify step (scheduler/speculative.py holds the other half).

It runs next to the target on the same device, language model only (media placeholders are plain tokens to it),
with 1-D positions, over a KV pool of its own: a few rows of one whole context each (slot = 1 + row * width +
position), so no allocator is needed. A request keeps its row, least recently proposed first out, and the KV
of every token the draft has seen: after a verify step the accepted drafts are already there (they are the
draft's own guesses), so the next proposal feeds only the step's new token; a rejected guess's KV is simply
overwritten. Greedy drafts make the proposer deterministic, which the verify rule's exactness relies on.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.config import ServerArgs, resolve_model_path
from tessera.layers.forward_batch import ForwardBatch
from tessera.models.registry import load_model
from tessera.platform.device import compute_dtype, resolve_dtype

logger = logging.getLogger("tessera.worker")


class DraftModel:
    def __init__(self, args: ServerArgs, device: torch.device, context_length: int, target_vocab: int, rows: int):
        path = resolve_model_path(args.speculative_draft_model_path)  # type: ignore[arg-type]
        self.model, self.config = load_model(path, dtype=args.dtype, device=device, language_model_only=True,
                                             attention_backend=args.attention_backend)
        if type(self.model).request_state is not None:
            raise ValueError("speculative_draft_model_path: the draft must be a decoder-only language model")
        self.device = device
        self.vocab = min(target_vocab, self.config.vocab_size)  # a draft id past the target's vocab ends a draft
        layout = self.model.kv_layout
        dtype = compute_dtype(resolve_dtype(args.dtype, self.config.dtype, device), device)
        self.width = context_length + 17  # a context and the longest draft
        self.pool = TokenToKVPool(rows * self.width, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                  dtype=dtype, device=device)
        self.req_to_token = (torch.arange(rows * self.width, dtype=torch.int64) + 1).view(rows, self.width).to(device)
        self.free_rows = list(range(rows))
        self.rows: OrderedDict[str, int] = OrderedDict()  # rid -> row, least recently proposed first
        self.seen: dict[str, list[int]] = {}  # rid -> tokens whose KV its row holds, in order
        self.mrope = self.config.positions == "mrope"
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        logger.info("draft model %s: %.1fM parameters, %d rows of %d tokens", os.path.basename(path),
                    self.num_parameters / 1e6, rows, self.width)

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.free_rows.append(row)
            self.seen.pop(rid, None)

    def _row(self, rid: str, busy: set[str]) -> int | None:
        if rid in self.rows:
            self.rows.move_to_end(rid)
            return self.rows[rid]
        if not self.free_rows:
            victim = next((r for r in self.rows if r not in busy), None)
            if victim is None:
                return None
            self.release(victim)
        self.rows[rid] = row = self.free_rows.pop()
        self.seen[rid] = []
        return row

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        """reqs: the scheduler's requests (rid, fill_ids). Up to limits[i] greedy draft tokens each."""
        drafts: list[list[int]] = [[] for _ in reqs]
        busy = {r.rid for r in reqs}
        todo = []  # (index, row, tokens to feed, first position)
        for i, (req, k) in enumerate(zip(reqs, limits)):
            fill = req.fill_ids
            if k <= 0 or len(fill) + k > self.width:
                continue
            row = self._row(req.rid, busy)
            if row is None:
                continue
            seen = self.seen[req.rid]
            valid = 0
            limit = min(len(seen), len(fill) - 1)  # the last token is always fed: its logits give the first draft
            while valid < limit and seen[valid] == fill[valid]:
                valid += 1
            todo.append((i, row, list(fill[valid:]), valid))
            self.seen[req.rid] = list(fill)
        for step in range(max((limits[i] for i, *_ in todo), default=0)):
            feed = [(i, row, tokens, start) for i, row, tokens, start in todo if step < limits[i]
                    and (step == 0 or len(drafts[i]) == step)]
            if not feed:
                break
            next_ids = self._forward(feed)
            for (i, _, tokens, start), token in zip(feed, next_ids):
                if token >= self.vocab:
                    continue  # not a token the target has: the draft ends here
                drafts[i].append(token)
            # The next step feeds each request its newest draft (whose KV the draft then holds).
            todo = [(i, row, [drafts[i][-1]], start + len(tokens)) for i, row, tokens, start in feed
                    if len(drafts[i]) == step + 1]
            for i, *_ in todo:
                self.seen[reqs[i].rid].append(drafts[i][-1])
        for i, req in enumerate(reqs):  # the last draft was never fed: its KV is not there
            if drafts[i] and req.rid in self.seen:
                self.seen[req.rid].pop()
        return drafts

    def _forward(self, feed: list[tuple[int, int, list[int], int]]) -> list[int]:
        ids, positions, locs, ext, seq, rows = [], [], [], [], [], []
        for _, row, tokens, start in feed:
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            locs.extend(1 + row * self.width + p for p in range(start, start + len(tokens)))
            ext.append(len(tokens))
            seq.append(start + len(tokens))
            rows.append(row)
        last = [sum(ext[:j + 1]) - 1 for j in range(len(ext))]
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        pos = t(positions)
        fb = ForwardBatch(input_ids=t(ids), positions=pos.expand(3, -1) if self.mrope else pos,
                          out_cache_loc=t(locs), req_pool_indices=t(rows), seq_lens=t(seq), extend_lens=t(ext),
                          req_to_token=self.req_to_token, logits_indices=t(last), host_seq_lens=seq,
                          host_extend_lens=ext, host_req_pool_indices=rows)
        return self.model(fb, self.pool).argmax(dim=-1).tolist()
