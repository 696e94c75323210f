"""ScheduledBatch: the requests the policy picked for one step and their token ranges; the scheduler turns it
into the worker's ForwardInput (scheduler/step_input.py)."""

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
    # Speculative decoding: draft tokens verified after the last known one (end covers them); [] otherwise.
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token: its logits give the next token (an embedding request
        samples nothing: its hidden states are pooled)."""
        return self.end == self.req.seq_len + len(self.draft) and self.req.pooling is None

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk (or a retracted request's recompute), not a decode or verify step."""
        return not self.draft and (self.end - self.start > 1 or not self.req.output_ids)


@dataclass
class ScheduledBatch:
    reqs: list[ScheduledReq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.end - r.start for r in self.reqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.end - r.start for r in self.reqs if r.is_prefill)

    def __len__(self) -> int:
        return len(self.reqs)
