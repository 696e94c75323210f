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

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.peer_fields import GENERATE_NOOPS, refusal
from tessera.entrypoints.openai.request_models import GENERATE_FIELDS
from tessera.entrypoints.openai.serving import OpenAIServing, check_batch
from tessera.entrypoints.openai.streaming import event_stream, sse
from tessera.frontend.request import GenerateRequest
from tessera.messages.sampling import SamplingParams

ACCEPTED = GENERATE_FIELDS  # declared with their types and meanings in openai/request_models.py
MODALITIES = {"image", "multi-images", "video", "audio"}


def _batch(body: dict) -> tuple[list[dict], bool]:
    """The prompts (text or input_ids) of the body and whether it was a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError("text: give exactly one of text or input_ids", param="text")
    if isinstance(text, list):
        if not text or not all(isinstance(t, str) for t in text):
            raise APIError("text: a batch must be a non-empty list of strings", param="text")
        return [dict(text=t) for t in text], True
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return [dict(input_ids=p) for p in ids], True
    return [dict(text=text) if text is not None else dict(input_ids=ids)], False


def _per_prompt(body: dict, name: str, n: int, batch: bool) -> list[Any]:
    """A per-prompt field: one value for a single prompt, a list of n values (or one shared) for a batch."""
    value = body.get(name)
    if not batch:
        return [value]
    if isinstance(value, list) and len(value) == n and name != "sampling_params":
        return value
    if name == "sampling_params" and isinstance(value, list):
        if len(value) != n:
            raise APIError(f"sampling_params: a list needs one entry per prompt ({n})", param="sampling_params")
        return value
    if value is None or name == "sampling_params" or name in ("return_logprob", "top_logprobs_num",
                                                              "logprob_start_len"):
        return [value] * n
    raise APIError(f"{name}: a batch of {n} prompts needs a list of {n} entries", param=name)


async def generate(serving: OpenAIServing, request: Request, body: dict):
    for name in sorted(set(body) - ACCEPTED):  # SGLang's own fields pass at their no-op values
        if name not in GENERATE_NOOPS:
            raise APIError(f"{name}: unknown or unsupported field (accepted: {', '.join(sorted(ACCEPTED))})",
                           param=name)
        why = refusal(name, body[name], GENERATE_NOOPS)
        if why is not None:
            raise APIError(f"{name}: {why} (accepted only at its no-op value)", param=name)
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list)
                                   or not all(isinstance(m, str) and m in MODALITIES for m in modalities)):
        raise APIError(f"modalities: a list of {sorted(MODALITIES)}", param="modalities")
    prompts, batch = _batch(body)
    check_batch(len(prompts), "text" if body.get("text") is not None else "input_ids")
    n = len(prompts)
    columns = {name: _per_prompt(body, name, n, batch) for name in
               ("sampling_params", "image_data", "video_data", "audio_data", "return_logprob", "top_logprobs_num",
                "logprob_start_len", "lora_path")}
    stream = bool(body.get("stream"))
    with_text = bool(body.get("return_text_in_logprobs"))
    reqs: list[GenerateRequest] = []
    for k, prompt in enumerate(prompts):
        try:
            sp = SamplingParams.from_dict(columns["sampling_params"][k] or {})
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="sampling_params") from None
        top = columns["top_logprobs_num"][k]
        if top is not None:
            sp.top_logprobs_num = top
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise APIError("cache_salt: must be a non-empty string", param="cache_salt")
        return_logprob = bool(columns["return_logprob"][k] or sp.top_logprobs_num)
        start = columns["logprob_start_len"][k]
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < -1):
            raise APIError(f"logprob_start_len: must be an integer >= -1, got {start!r}", param="logprob_start_len")
        base = dict(**prompt, image_data=columns["image_data"][k], video_data=columns["video_data"][k],
                    audio_data=columns["audio_data"][k], stream=stream, cache_salt=salt,
                    lora_path=serving.tm.lora.resolve(columns["lora_path"][k]),
                    return_logprob=return_logprob,
                    logprob_start_len=start if return_logprob and start is not None else -1)
        reqs += serving.fan_out(base, sp)
    if body.get("rid") is not None:
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        if len(rids) != len(reqs) or not all(isinstance(r, str) for r in rids):
            raise APIError(f"rid: one string per output ({len(reqs)})", param="rid")
        for r, rid in zip(reqs, rids):
            r.rid = rid
    tokenized = await serving.prepare(reqs, {})

    def shaped(out: dict, index: int) -> dict:
        meta = dict(out["meta_info"])
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
        if out["meta_info"].get("output_token_logprobs") is not None:
            meta.setdefault("output_top_logprobs", [])
            meta.setdefault("input_token_logprobs", [])
            meta.setdefault("input_top_logprobs", [])
        result = {"text": out["text"], "output_ids": out["output_ids"], "meta_info": meta}
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
