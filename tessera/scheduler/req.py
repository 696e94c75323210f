"""Req: a request's state inside the scheduler process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tessera.multimodal.items import MultimodalInputs
from tessera.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None
    stream: bool = False
    return_logprob: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    # KV state. kv_len tokens of fill_ids have KV at req_to_token[req_pool_idx, :kv_len].
    req_pool_idx: int | None = None
    kv_len: int = 0
    cached_len: int = 0  # tokens of the prompt served from the prefix cache (reported to users)
    prefix_len: int = 0  # length owned by the radix tree and locked through last_node
    last_node: object = None
    num_retractions: int = 0
    # Output bookkeeping: what has been sent to the frontend already.
    num_sent: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    _padded_prompt: list[int] | None = None
    # Encoder outputs of this request's items, held from the first prefill chunk to the last.
    mm_embed_stash: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def is_prefill_done(self) -> bool:
        """All tokens but the last sampled one have KV: the next step is a decode step."""
        return self.kv_len >= self.seq_len - 1 and self.kv_len > 0

    @property
    def remaining_extend(self) -> int:
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def cache_key(self) -> list[int]:
        """Prefix-cache key of fill_ids: multimodal placeholders replaced by the items' pad values."""
        if self._padded_prompt is None:
            ids = self.origin_input_ids
            self._padded_prompt = self.mm_inputs.pad_input_ids(ids) if self.mm_inputs else list(ids)
        return self._padded_prompt + self.output_ids

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of fill_ids[start:end]."""
        prompt_len = len(self.origin_input_ids)
        mm = self.mm_inputs
        delta = mm.mrope_position_delta if mm is not None else 0
        parts = []
        if start < prompt_len:
            if mm is not None and mm.mrope_positions is not None:
                parts.append(mm.mrope_positions[:, start : min(end, prompt_len)])
            else:
                parts.append(torch.arange(start, min(end, prompt_len)).expand(3, -1))
        if end > prompt_len:
            lo = max(start, prompt_len)
            parts.append(torch.arange(lo + delta, end + delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
