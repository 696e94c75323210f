"""ForwardBatch: everything one model step needs, built by the scheduler, read by the model.

One step runs any mix of prefill chunks and decode tokens ("extend" of length 1). Tokens of
all requests are flattened in request order. Request i owns rows
[extend_start_loc[i], extend_start_loc[i] + extend_lens[i]) of the flat tensors, its KV lives
at slots req_to_token[req_pool_indices[i], :seq_lens[i]], and the new tokens' KV is written to
out_cache_loc (same order as the flat tokens) before attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long; real token ids (placeholders keep the model's image token id)
    positions: torch.Tensor  # [3, T] long for M-RoPE models ([T] broadcast to 3 rows for plain RoPE)
    out_cache_loc: torch.Tensor  # [T] long, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] long, rows of req_to_token
    seq_lens: torch.Tensor  # [B] long, KV length of each request after this step
    extend_lens: torch.Tensor  # [B] long, new tokens of each request in this step
    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int64 slot table (shared, owned by ReqToTokenPool)
    # Rows of the final hidden states to turn into logits (last new token of each request that samples).
    logits_indices: torch.Tensor | None = None
    # Multimodal embeddings to scatter: (flat row indices [n], embeddings [n, hidden]).
    mm_embed_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    # Optional per-request attention masks: None = causal. A mask is bool [extend_len, seq_len],
    # True = may attend (e.g. bidirectional inside an image span for Gemma-3).
    custom_masks: list[torch.Tensor | None] | None = None
    # Allocation generation of each request's req_to_token row (ReqToTokenPool.generation): with the row it
    # names a request's KV for caches kept across steps (the decode K/V mirror). None: no such caching.
    req_generations: list[int] | None = None
    # Host copies of the per-request lengths and rows, when the caller has them (the worker always does):
    # backends plan from these instead of reading the device tensors back (a sync per step on CUDA).
    host_seq_lens: list[int] | None = None
    host_extend_lens: list[int] | None = None
    host_req_pool_indices: list[int] | None = None
    # Families with per-request state (models/request_state.py): each request's slots of it in the pool
    # [B, max extra_slots] (cross-attention K/V of its media), its first state_lens[b] entries (the rest slot 0),
    # and what RequestState.layout said of its items. None: the family keeps none.
    state_slots: torch.Tensor | None = None
    state_lens: list[int] | None = None
    state_layouts: list[Any] | None = None
    # Hybrid models (cache/state_pool.py): state-pool copies (source, destination) the model makes in order
    # before the step (prefix-cache snapshots into and out of request rows), and saves during it: (request, its
    # tokens of the step, snapshot slot), each linear-attention layer's state after that many new tokens.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # Every request adds one token and attends causally (no custom masks, no media). Set by the CUDA-graph
    # runner, whose batches carry no host copies (a captured graph replays with other values): a backend that
    # supports graphs plans such a batch from its device tensors alone.
    decode_only: bool = False
    # Some row adds a LoRA adapter (layers/lora): the decode stack's C driver, which knows no adapters, stands by.
    lora_rows: bool = False
    # Embedding requests (worker/pooling.py): flat rows whose final hidden states the model also hands back, in
    # `hidden_states` (set by the model's forward; None when nobody asked).
    hidden_indices: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    extend_start_loc: torch.Tensor = field(init=False)
    prefix_lens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.prefix_lens = self.seq_lens - self.extend_lens
        self.extend_start_loc = torch.cumsum(self.extend_lens, 0) - self.extend_lens

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_plan(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(extend_lens, seq_lens, extend starts, req rows) as Python ints; read back from the device only
        when the batch was built without host copies."""
        if self.host_seq_lens is not None and self.host_extend_lens is not None and \
                self.host_req_pool_indices is not None:
            ext, seq, rows = self.host_extend_lens, self.host_seq_lens, self.host_req_pool_indices
            starts, acc = [], 0
            for n in ext:
                starts.append(acc)
                acc += n
            return list(ext), list(seq), starts, list(rows)
        ext, seq, starts, rows = torch.stack(
            [self.extend_lens, self.seq_lens, self.extend_start_loc, self.req_pool_indices.to(self.seq_lens.dtype)]
        ).tolist()
        return ext, seq, starts, rows
