"""SGLang's native /generate: one prompt or a batch, SGLang's request fields and output shape.

Logprob entries are SGLang's (logprob, token_id, text-or-None); text only with return_text_in_logprobs.
With return_logprob, logprob_start_len >= 0 adds the prompt tokens' logprobs from that position on
(input_token_logprobs; the first prompt token's is None) and, with top_logprobs_num, input_top_logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tessera.entrypoints.openai import request_models as rm
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.serving import OpenAIServing, check_batch
from tessera.entrypoints.openai.streaming import event_stream, sse
from tessera.frontend.request import GenerateRequest
from tessera.frontend.result import GenerateResult
from tessera.messages.sampling import SamplingParams

_PER_PROMPT = ("sampling_params", "image_data", "video_data", "audio_data", "return_logprob", "top_logprobs_num",
               "logprob_start_len", "lora_path")
_SHARED_IN_A_BATCH = ("sampling_params", "return_logprob", "top_logprobs_num", "logprob_start_len")


def _batch(req: rm.GenerateRequest) -> tuple[list[dict], bool]:
    """The prompts (text or input_ids) of the request and whether it was a batch."""
    text, ids = req.text, req.input_ids
    if (text is None) == (ids is None):
        raise APIError("text: give exactly one of text or input_ids", param="text")
    if isinstance(text, list):
        if not text:
            raise APIError("text: a batch must be a non-empty list of strings", param="text")
        return [dict(text=t) for t in text], True
    if ids and isinstance(ids[0], list):
        return [dict(input_ids=p) for p in ids], True
    return [dict(text=text) if text is not None else dict(input_ids=ids)], False


def _per_prompt(req: rm.GenerateRequest, name: str, n: int, batch: bool) -> list[Any]:
    """A per-prompt field: one value for a single prompt, a list of n values (or one shared) for a batch."""
    value = getattr(req, name)
    if not batch:
        return [value]
    if isinstance(value, list) and len(value) == n and name != "sampling_params":
        return value
    if name == "sampling_params" and isinstance(value, list):
        if len(value) != n:
            raise APIError(f"sampling_params: a list needs one entry per prompt ({n})", param="sampling_params")
        return value
    if value is None or name in _SHARED_IN_A_BATCH:
        return [value] * n
    raise APIError(f"{name}: a batch of {n} prompts needs a list of {n} entries", param=name)


def _requests(serving: OpenAIServing, req: rm.GenerateRequest) -> tuple[list[GenerateRequest], bool]:
    """The one mapping of a /generate request to the engine's requests (n of each prompt); whether a batch."""
    prompts, batch = _batch(req)
    # sglang-router adds "model" (null, or the name it knows the worker by); "base:adapter" picks an adapter.
    model_adapter = serving.check_model(req.model)
    check_batch(len(prompts), "text" if req.text is not None else "input_ids")
    columns = {name: _per_prompt(req, name, len(prompts), batch) for name in _PER_PROMPT}
    reqs: list[GenerateRequest] = []
    for k, prompt in enumerate(prompts):
        try:
            sp = SamplingParams.from_dict(columns["sampling_params"][k] or {})
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="sampling_params") from None
        top = columns["top_logprobs_num"][k]
        if top is not None:
            sp.top_logprobs_num = top
        return_logprob = bool(columns["return_logprob"][k] or sp.top_logprobs_num)
        start = columns["logprob_start_len"][k]
        if start is not None and (not isinstance(start, int) or start < -1):
            raise APIError(f"logprob_start_len: must be an integer >= -1, got {start!r}", param="logprob_start_len")
        base = dict(**prompt, image_data=columns["image_data"][k], video_data=columns["video_data"][k],
                    audio_data=columns["audio_data"][k], stream=bool(req.stream), cache_salt=req.cache_salt,
                    lora_path=(serving.tm.lora.resolve(columns["lora_path"][k]) if columns["lora_path"][k] is not None
                               else model_adapter),
                    return_logprob=return_logprob,
                    logprob_start_len=start if return_logprob and start is not None else -1)
        reqs += serving.fan_out(base, sp)
    if req.rid is not None:
        rids = req.rid if isinstance(req.rid, list) else [req.rid]
        if len(rids) != len(reqs):
            raise APIError(f"rid: one string per output ({len(reqs)})", param="rid")
        for r, rid in zip(reqs, rids):
            r.rid = rid
    return reqs, batch


async def generate(serving: OpenAIServing, request: Request, req: rm.GenerateRequest):
    reqs, batch = _requests(serving, req)
    stream, with_text = bool(req.stream), bool(req.return_text_in_logprobs)
    media = next((f for f in ("image_data", "video_data", "audio_data") if getattr(req, f) is not None), None)
    tokenized = await serving.prepare(reqs, {}, media_param=media)

    def shaped(out: GenerateResult, index: int) -> dict:
        meta = out.meta_info()
        for key in ("output_token_logprobs",):
            if key in meta:
                meta[key] = [_entry(serving, lp, tid, with_text) for lp, tid in meta[key]]
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = [[_entry(serving, lp, tid, with_text) for lp, tid in top]
                                           for top in meta["output_top_logprobs"]]
        if "input_token_logprobs" in meta:
            meta["input_token_logprobs"] = [_entry(serving, lp, tid, with_text)
                                            for lp, tid in meta["input_token_logprobs"]]
            meta["input_top_logprobs"] = [top and [_entry(serving, lp, tid, with_text) for lp, tid in top]
                                          for top in meta["input_top_logprobs"] or []]
        if out.output_token_logprobs is not None:
            meta.setdefault("output_top_logprobs", [])
            meta.setdefault("input_token_logprobs", [])
            meta.setdefault("input_top_logprobs", [])
        result = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
        if len(reqs) > 1:
            result["index"] = index
        return result

    if stream:
        async def gen() -> AsyncIterator[str]:
            async for i, out in serving.merged_stream(reqs, tokenized):
                yield sse(shaped(out, i))
            yield sse("[DONE]")

        return event_stream(gen())
    outs = await serving.collect_all(request, reqs, tokenized)
    results = [shaped(o, i) for i, o in enumerate(outs)]
    return JSONResponse(results if batch or len(results) > 1 else results[0])


def _entry(serving: OpenAIServing, logprob: float, token_id: int, with_text: bool) -> tuple:
    return logprob, token_id, serving.tm.tokenizer.decode([token_id]) if with_text else None
