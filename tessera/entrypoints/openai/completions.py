"""/v1/completions: prompts (text, token ids or batches of either), echo and legacy logprobs.

Each prompt fans out into n requests; usage counts a prompt once however many samples share it. With echo
and logprobs the prompt tokens' logprobs come first (computed in the prefill, logprob_start_len 0), the first
one null as OpenAI's; a stream sends the echoed prompt with them in its first chunk. vLLM's prompt_logprobs
come from the same prefill rows (prompt_logprobs.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.prompt_logprobs import ask_prompt_logprobs, prompt_logprobs_of, vllm_prompt_logprobs
from tessera.entrypoints.openai.protocol import StreamOptions, sampling_params_from_openai, stream_options, user_names
from tessera.entrypoints.openai.request_models import CompletionRequest
from tessera.entrypoints.openai.serving import OpenAIServing, check_batch, response_id
from tessera.entrypoints.openai.streaming import ChunkWriter, event_stream, usage_of
from tessera.frontend.request import GenerateRequest
from tessera.frontend.result import GenerateResult


async def create_completion(serving: OpenAIServing, request: Request, req: CompletionRequest):
    if req.best_of not in (None, 1, req.n):
        raise APIError("best_of: only best_of == n is supported (every sample is returned)", param="best_of")
    if req.suffix:
        raise APIError("suffix: insertion (fill-in-the-middle) is not supported", param="suffix")
    lora = serving.check_model(req.model, req.lora_path)
    opts = stream_options(req)
    prompts = prompts_of(req.prompt)
    check_batch(len(prompts), "prompt")
    sp = sampling_params_from_openai(req, default_max_tokens=16, vocab_size=serving.tm.info.vocab_size)
    echo = bool(req.echo)
    prompt_k = prompt_logprobs_of(req.prompt_logprobs, opts.stream)
    out_top = ask_prompt_logprobs(sp, prompt_k)
    with_prompt = prompt_k is not None or bool(echo and sp.logprobs)
    reqs: list[GenerateRequest] = []
    echoes: list[str] = []
    for p in prompts:
        new = serving.fan_out(dict(**p, return_logprob=bool(sp.logprobs), stream=opts.stream,
                                   cache_salt=req.cache_salt, logprob_start_len=0 if with_prompt else -1,
                                   prompt_logprob_ranks=prompt_k is not None, lora_path=lora), sp)
        reqs += new
        text = p.get("text")
        if echo and text is None:
            text = serving.tm.tokenizer.decode(p["input_ids"])
        echoes += [text if echo else ""] * len(new)
    tokenized = await serving.prepare(reqs, user_names(req))
    rid, created = response_id("cmpl", request), int(time.time())
    if opts.stream:
        return event_stream(_completion_stream(serving, reqs, tokenized, rid, created, opts, echoes, len(prompts),
                                               serving.answer_model(lora, req.model)))
    outs = await serving.collect_all(request, reqs, tokenized)
    choices = []
    for i, out in enumerate(outs):
        extra = {}
        if prompt_k is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(serving.token_text, out, prompt_k)
            out = out.with_alternatives_cut(out_top)
        lp = None
        if sp.logprobs:
            lp = _completion_logprobs(serving, out, 0, len(echoes[i]))
            lp = _with_prompt(serving, out, lp) if echo else lp
        choices.append({"index": i, "text": echoes[i] + out.text, "logprobs": lp,
                        "finish_reason": out.openai_finish_reason, "matched_stop": out.matched_stop, **extra})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                         "model": serving.answer_model(lora, req.model),
                         "choices": choices, "usage": usage_of(outs, len(prompts))})


def _completion_logprobs(serving: OpenAIServing, out: GenerateResult, start: int, offset: int) -> dict:
    """OpenAI's legacy logprobs for output tokens [start:], their text offsets from `offset`."""
    return _legacy_logprobs(serving, out.output_logprobs[start:], out.output_tops[start:], offset)


def _with_prompt(serving: OpenAIServing, out: GenerateResult, logprobs: dict) -> dict:
    """`logprobs` (of output tokens) preceded by the prompt tokens' when the request echoed them."""
    if out.input_token_logprobs is None:
        return logprobs
    prompt = _legacy_logprobs(serving, out.input_token_logprobs, out.input_top_logprobs or [], 0)
    return {key: prompt[key] + logprobs[key] for key in prompt}


def _legacy_logprobs(serving: OpenAIServing, pairs: list, tops: list, offset: int) -> dict:
    """Each top_logprobs entry holds the `logprobs` most likely tokens and the chosen one (so logprobs=0
    still gives one entry); a token nothing predicts (the first of a prompt) has null for both."""
    tokens = [serving.token_text(t) for _, t in pairs]
    top_logprobs, text_offset = [], []
    for k, (lp, tid) in enumerate(pairs):
        entry = None
        if lp is not None:
            entry = {serving.token_text(t): v for v, t in ((tops[k] if k < len(tops) else None) or [])}
            entry.setdefault(tokens[k], lp)
        top_logprobs.append(entry)
        text_offset.append(offset)
        offset += len(tokens[k])
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top_logprobs,
            "text_offset": text_offset}


async def _completion_stream(serving: OpenAIServing, reqs, tokenized, rid: str, created: int,
                             opts: StreamOptions, echoes: list[str], num_prompts: int,
                             model: str) -> AsyncIterator[str]:
    writer = ChunkWriter(rid, created, model, "text_completion", opts,
                         [len(t.input_ids) for t in tokenized])

    def chunk(i: int, text: str, finish: str | None = None, logprobs=None,
              result: GenerateResult | None = None) -> str:
        return writer(i, {"text": text}, finish, logprobs, result)

    # Echoed prompts go first, except those with prompt logprobs: they travel with their first output.
    pending = {i: text for i, text in enumerate(echoes) if text and reqs[i].logprob_start_len >= 0}
    for i, text in enumerate(echoes):
        if text and i not in pending:
            yield chunk(i, text)
    finished: dict[int, GenerateResult] = {}
    sent_tokens: dict[int, int] = {}
    offsets = {i: len(text) for i, text in enumerate(echoes)}
    async for i, out in serving.merged_stream(reqs, tokenized):
        finish = out.openai_finish_reason
        lp = None
        if reqs[i].return_logprob:
            lp = _completion_logprobs(serving, out, sent_tokens.get(i, 0), offsets[i])
            sent_tokens[i] = len(out.output_logprobs)
            offsets[i] += sum(len(t) for t in lp["tokens"])
        text = out.delta
        if i in pending and out.input_token_logprobs is not None:
            text = pending.pop(i) + text
            lp = _with_prompt(serving, out, lp)
        if text or finish or (lp and lp["tokens"]):
            yield chunk(i, text, finish, lp, out)
        if finish is not None:
            finished[i] = out
    for tail in writer.end(finished, num_prompts):
        yield tail


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict]:
    """A completions prompt (a string, a list of strings, a list of token ids or a list of such lists; the types
    checked by its model) as the requests' text or input_ids; none may be empty."""
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if not all(batch):
        raise APIError("prompt: must be a non-empty string, a list of strings, a list of token ids or a list of "
                       "token-id lists", param="prompt")
    return [dict(text=p) if isinstance(p, str) else dict(input_ids=p) for p in batch]
