"""vLLM's `prompt_logprobs` on /v1/completions and /v1/chat/completions, from the prefill's prompt logprobs.

`prompt_logprobs: k` asks, for every prompt token, its logprob and rank and the k most likely tokens at that
position; the answer is a list with None for the first token (nothing predicts it), then per token a map
{token id: {"logprob", "rank", "decoded_token"}}: the prompt token first, then the k alternatives ranked 1..k
(so k or k + 1 entries), logprobs clamped at -9999 as vLLM's. Completions put it on each choice, chat on the
response (its choices share the prompt). As vLLM, not with stream.

The engine computes one set of alternatives per request for prompt and output tokens alike: the request asks
max(k, the output's count) and the output's alternatives are cut back to what the body asked here.
"""

from __future__ import annotations

from tessera.entrypoints.openai.errors import APIError
from tessera.frontend.result import GenerateResult
from tessera.messages.sampling import MAX_TOP_LOGPROBS_NUM, SamplingParams

MIN_LOGPROB = -9999.0  # vLLM's clamp: JSON has no -inf


def prompt_logprobs_of(k: int | None, stream: bool) -> int | None:
    """The request's prompt_logprobs, checked."""
    if k is None:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS_NUM:
        raise APIError(f"prompt_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS_NUM}], got {k!r}",
                       param="prompt_logprobs")
    if stream:
        raise APIError("prompt_logprobs: not available when stream is true", param="prompt_logprobs")
    return k


def ask_prompt_logprobs(sp: SamplingParams, k: int | None) -> int:
    """Widens the request's alternatives to k; returns the count the output tokens keep."""
    out_top = sp.top_logprobs_num
    if k is not None:
        sp.top_logprobs_num = max(out_top, k)
    return out_top


def vllm_prompt_logprobs(token_text, result: GenerateResult, k: int) -> list[dict | None]:
    """The response's prompt_logprobs from a result's prompt logprobs (asked with logprob_start_len 0)."""
    pairs, tops = result.input_token_logprobs or [], result.input_top_logprobs or []
    ranks = result.input_token_ranks or []
    out: list[dict | None] = []
    for p, (lp, tid) in enumerate(pairs):
        if lp is None:
            out.append(None)
            continue
        entry = {tid: {"logprob": max(lp, MIN_LOGPROB), "rank": ranks[p], "decoded_token": token_text(tid)}}
        for rank, (alt_lp, alt) in enumerate(((tops[p] if p < len(tops) else None) or [])[:k], start=1):
            entry.setdefault(alt, {"logprob": max(alt_lp, MIN_LOGPROB), "rank": rank,
                                   "decoded_token": token_text(alt)})
        out.append(entry)
    return out
