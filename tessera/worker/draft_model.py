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
from tessera.layers import decode_stack
from tessera.layers.forward_batch import ForwardBatch
from tessera.models.registry import load_model
from tessera.platform.device import compute_dtype, is_host, resolve_dtype

logger = logging.getLogger("tessera.worker")
FAST_ROWS = 16  # new tokens in one draft forward up to which the decode stack runs it (a prompt goes as an extend)


class DraftModel:
    def __init__(self, args: ServerArgs, device: torch.device, context_length: int, target_vocab: int, rows: int):
        path = resolve_model_path(args.speculative_draft_model_path)  # type: ignore[arg-type]
        self.model, self.config = load_model(path, dtype=args.dtype, device=device, language_model_only=True,
                                             attention_backend=args.attention_backend)
        if type(self.model).request_state is not None or self.model.state_layout is not None:
            raise ValueError("speculative_draft_model_path: the draft must be a decoder-only language model "
                             "(without linear-attention state: its own rollback is not built)")
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
        self.softcap = bool(getattr(self.config, "final_logit_softcap", None))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # _decode_rows' cos, sin by position
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
            valid = min(len(seen), len(fill) - 1)  # the last token is always fed: its logits give the first draft
            if seen[:valid] != fill[:valid]:  # compared in C: a walk in Python cost ~0.1 ms at 1K tokens
                valid = next(i for i, (a, b) in enumerate(zip(seen, fill)) if a != b)
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
        if sum(len(tokens) for _, _, tokens, _ in feed) <= FAST_ROWS:
            out = self._decode_rows(feed)
            if out is not None:
                return out
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

    def _decode_rows(self, feed: list[tuple[int, int, list[int], int]]) -> list[int] | None:
        """A few new tokens straight through the CPU decode stack (layers/decode_stack.run_rows), one decode row
        each: a row attends to its request's KV up to itself, which the stack writes for every row before
        attending, so a request's tokens after a verify step (its last accepted draft and the step's new
        token) go in one call too. A row's slots are its request's own row of req_to_token, so neither a
        ForwardBatch nor the attention backend's plan is needed, and at a draft's size those were most of a
        forward (0.87 ms for such a feed as an extend, against 0.2 ms per token here; the same kernels).
        None where the stack does not run this model (a GPU, another block, 16-bit weights)."""
        if self.softcap or not is_host(self.device):
            return None
        ids, pos, loc, lens, rows, last = [], [], [], [], [], []
        for _, row, tokens, start in feed:
            ids += tokens
            pos += range(start, start + len(tokens))
            loc += range(1 + row * self.width + start, 1 + row * self.width + start + len(tokens))
            lens += range(start + 1, start + len(tokens) + 1)
            rows += [row] * len(tokens)
            last.append(len(ids) - 1)
        host = torch.tensor([ids, pos, loc, lens], dtype=torch.int64)
        pos_t = host[1]
        if len(feed) == 1:  # one request: its row of req_to_token for every token, not copied
            slots = self.req_to_token[rows[0]:rows[0] + 1].expand(len(ids), -1)
        else:
            slots = self.req_to_token[rows]
        decoder = self.model.model
        x = decoder.embed_tokens(host[0])
        if self._rope is None:  # every position of a row, once: a lookup is a third of computing them per step
            self._rope = decoder.rotary_emb.get_cos_sin(torch.arange(self.width), x.dtype)
        cos, sin = self._rope[0][pos_t], self._rope[1][pos_t]
        hidden = decode_stack.run_rows(decoder, x, cos, sin, host[2], slots, host[3], self.pool)
        if hidden is None:
            return None
        if len(last) != len(ids):
            hidden = hidden[last]
        return self.model.lm_head(hidden).argmax(dim=-1).tolist()
