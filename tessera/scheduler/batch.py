"""ScheduledBatch: what the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.scheduler.req import Req


@dataclass
class ScheduledReq:
    req: Req
    start: int  # extend fill_ids[start:end] this step; KV for [0, start) already exists
    end: int
    out_cache_loc: torch.Tensor  # [end - start] KV slots for the new tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token: its logits give the next token (an embedding request
        samples nothing: its hidden states are pooled)."""
        return self.end == self.req.seq_len and self.req.pooling is None


@dataclass
class ScheduledBatch:
    reqs: list[ScheduledReq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.end - r.start for r in self.reqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.end - r.start for r in self.reqs if r.end - r.start > 1 or not r.req.output_ids)

    def __len__(self) -> int:
        return len(self.reqs)
