"""GenerateResult: the frontend's typed answer to one generate (or embedding) request, handed to every endpoint.

The TokenizerManager accumulates the scheduler's incremental messages.ReqOutput into one (cumulative while a
request streams, final at its end); the endpoints read its fields, and the SGLang shapes (the Engine's output
dict, /generate's meta_info) are written from it here only: `meta_info()` and `to_dict()`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from tessera.frontend.request import EngineUnavailable, RequestFailed
from tessera.messages.finish import FinishReason
from tessera.messages.frontend import ReqOutput


@dataclass
class GenerateResult:
    rid: str
    text: str  # all the output text released so far (a stop string cut off unless no_stop_trim)
    delta: str  # the text released by this message
    output_ids: list[int]
    finish_reason: FinishReason | None  # None until the last message
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    e2e_latency: float  # seconds since the request reached the frontend
    ttft: float | None  # seconds to the first output token (None before it, and for embeddings)
    # With return_logprob: (logprob, token id) per output token; their alternatives only when asked (else None).
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Prompt logprobs (asked with logprob_start_len >= 0), SGLang's order: (logprob or None, token id) per prompt
    # token; alternatives per token (or None), each prompt token's rank when asked.
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ranks: list[int | None] | None = None
    spec_verify_ct: int = 0  # speculative decoding: this request's verify steps and the drafts they accepted
    spec_accepted_tokens: int = 0
    embedding: Any = None  # an embedding request's pooled vector (float32 torch tensor [dims])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def openai_finish_reason(self) -> str | None:
        """OpenAI's finish_reason of the choice (None while it goes on)."""
        return None if self.finish_reason is None else self.finish_reason.openai

    @property
    def matched_stop(self) -> int | str | None:
        """SGLang's matched_stop of the choice: the stop token id or string that ended it."""
        return None if self.finish_reason is None else self.finish_reason.matched_stop

    @property
    def output_logprobs(self) -> list[tuple[float, int]]:
        return self.output_token_logprobs or []

    @property
    def output_tops(self) -> list[list[tuple[float, int]]]:
        return self.output_top_logprobs or []

    def with_alternatives_cut(self, top: int) -> GenerateResult:
        """This result with the output's (and an echoed prompt's) alternatives cut back to `top` per token (the
        request asked more for vLLM's prompt_logprobs)."""
        def cut(tops):
            return [t and t[:top] for t in tops] if tops else tops
        return dataclasses.replace(self, output_top_logprobs=cut(self.output_top_logprobs),
                                   input_top_logprobs=cut(self.input_top_logprobs))

    def meta_info(self) -> dict:
        """SGLang's meta_info: the fields every answer has, then the logprobs and speculative counters that
        this request asked for or had."""
        meta: dict = {
            "id": self.rid,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_meta(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": self.e2e_latency,
            "ttft": self.ttft,
        }
        if self.output_token_logprobs is not None:
            meta["output_token_logprobs"] = self.output_token_logprobs
            if self.output_top_logprobs:
                meta["output_top_logprobs"] = self.output_top_logprobs
        if self.spec_verify_ct:  # SGLang's names; the accept length: tokens per verify step of this request
            meta.update(spec_verify_ct=self.spec_verify_ct,
                        spec_accept_length=1 + self.spec_accepted_tokens / self.spec_verify_ct)
        if self.input_token_logprobs is not None:
            meta.update(input_token_logprobs=self.input_token_logprobs, input_top_logprobs=self.input_top_logprobs)
            if self.input_token_ranks is not None:
                meta["input_token_ranks"] = self.input_token_ranks
        return meta

    def to_dict(self) -> dict:
        """The Engine's output dict (SGLang's): text, delta, output_ids, meta_info and an embedding's vector."""
        out = {"text": self.text, "delta": self.delta, "output_ids": list(self.output_ids),
               "meta_info": self.meta_info()}
        if self.embedding is not None:
            out["embedding"] = self.embedding
        return out


def answer_of(rid: str, out: ReqOutput, prompt_tokens: int, created: float, first_token_time: float | None,
              text: str = "", delta: str = "", output_ids: list[int] | None = None) -> GenerateResult:
    """The result after `out` (the request's latest message): its counters and finish; the caller adds the
    logprobs it accumulated. prompt_tokens: the frontend's count, for an answer the scheduler never counted."""
    output_ids = output_ids if output_ids is not None else []
    return GenerateResult(
        rid=rid, text=text, delta=delta, output_ids=output_ids, finish_reason=out.finished_reason,
        prompt_tokens=out.prompt_tokens or prompt_tokens, completion_tokens=len(output_ids),
        cached_tokens=out.cached_tokens, e2e_latency=time.monotonic() - created,
        ttft=(first_token_time - created) if first_token_time else None,
        spec_verify_ct=out.spec_verify_ct, spec_accepted_tokens=out.spec_accepted_tokens, embedding=out.embedding)


def failure(reason: FinishReason) -> Exception:
    """The exception a failed request ends with: EngineUnavailable (HTTP 503, its message public) when no
    scheduler can serve it, else RequestFailed (HTTP 500)."""
    return (EngineUnavailable if reason.unavailable else RequestFailed)(reason.message)
