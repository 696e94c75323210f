"""Req: a request's state inside the scheduler process."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from tessera.constrained.matcher import GrammarMatcher
from tessera.messages.finish import FinishReason
from tessera.messages.items import MultimodalInputs
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams


def salted_key(salt: str, first: int) -> int:
    """The first cache-key token of a salted request: a negative int (never a token id or a media pad
    value), so the whole radix path of a salt is its own. Stable across processes (blake2b, not hash())."""
    digest = hashlib.blake2b(f"{salt}\0{first}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None
    stream: bool = False
    return_logprob: bool = False
    cache_salt: str | None = None
    # SGLang's logprob_start_len: >= 0 asks the prompt logprobs of tokens from there on (-1: none).
    logprob_start_len: int = -1
    prompt_logprob_ranks: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
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
    # Prompt logprobs by token, from logprob_start_len (the first prompt token's stays None: nothing predicts
    # it); written by position, so a chunk computed again after a retraction overwrites the same values.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_ranks: list[int | None] = field(default_factory=list)
    input_logprobs_done: bool = False  # every asked prompt row was computed
    input_logprobs_sent: bool = False
    _padded_prompt: list[int] | None = None
    # Token ranges that must be computed in one step (media attended bidirectionally); [] for most families.
    atomic_spans: list[tuple[int, int]] = field(default_factory=list)
    # Families with per-request state (models/request_state.py): its pool slots while the request is
    # admitted, and whether a step has been sent that fills them (from its encoder output).
    state_slots: torch.Tensor | None = None
    state_filled: bool = False
    # The output constraint's matcher (tessera/constrained), advanced with every output token; it has
    # consumed exactly output_ids, so it stays valid across retraction. None when decoding is free.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: verify steps this request ran and the drafts they accepted.
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    lora_name: str | None = None  # its LoRA adapter (None: the base model); part of the cache key
    # An embedding request (messages/pooling.py): prefill only, it finishes with its pooled vector.
    pooling: PoolingParams | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids."""
        prompt = self.origin_input_ids
        if end <= len(prompt):
            return prompt[start:end]
        out = self.output_ids[max(start - len(prompt), 0):end - len(prompt)]
        return prompt[start:] + out if start < len(prompt) else out

    @property
    def wants_input_logprobs(self) -> bool:
        return 0 <= self.logprob_start_len < len(self.origin_input_ids)

    def input_logprob_rows(self) -> tuple[int, int]:
        """Prompt positions [lo, hi) whose logits give the asked prompt logprobs (row p predicts token p + 1);
        a cached prefix must end by lo, since a cached row has no logits."""
        return max(self.logprob_start_len, 1) - 1, len(self.origin_input_ids) - 1

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
            # An adapter's K/V differ from the base model's and every other adapter's: its own radix path.
            salt = self.cache_salt if self.lora_name is None else f"{self.cache_salt or ''}\0lora:{self.lora_name}"
            media = self.mm_inputs.cross_media_salt() if self.mm_inputs else None
            if media is not None:
                salt = f"{salt or ''}\0{media}"
            if salt is not None and self._padded_prompt:
                self._padded_prompt[0] = salted_key(salt, self._padded_prompt[0])
        return self._padded_prompt + self.output_ids
