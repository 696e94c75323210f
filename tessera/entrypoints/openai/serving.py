"""OpenAI chat/completions and native /generate handlers over the TokenizerManager."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.protocol import parse_chat_messages, sampling_params_from_openai
from tessera.frontend.request import GenerateRequest
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.5


def _finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(fr["type"], fr["type"])


def _usage(metas: list[dict]) -> dict:
    prompt = metas[0]["prompt_tokens"] if metas else 0
    completion = sum(m["completion_tokens"] for m in metas)
    cached = metas[0]["cached_tokens"] if metas else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm, self.model_name = tm, model_name

    # ---- helpers ------------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name not in (None, "", "default", self.model_name, self.tm.args.model_path):
            raise APIError(f"model: the model {name!r} does not exist; this server serves {self.model_name!r}",
                           status=404, param="model")

    def _fan_out(self, base: dict, sp: SamplingParams) -> list[GenerateRequest]:
        reqs = []
        for i in range(sp.n):
            seed = None if sp.seed is None else sp.seed + i
            params = SamplingParams(**{**sp.__dict__, "n": 1, "seed": seed})
            reqs.append(GenerateRequest(sampling_params=params, **base))
        return reqs

    async def _collect_all(self, request: Request, reqs: list[GenerateRequest]) -> list[dict]:
        """Runs the requests to completion; aborts them all if the client disconnects."""

        async def one(r: GenerateRequest) -> dict:
            out = None
            async for out in self.tm.generate(r):
                pass
            return out

        task = asyncio.ensure_future(asyncio.gather(*(one(r) for r in reqs)))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()  # each generate()'s finally sends AbortReq, freeing the KV
                raise asyncio.CancelledError

    async def _merged_stream(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, dict]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, r: GenerateRequest) -> None:
            try:
                async for out in self.tm.generate(r):
                    await queue.put((i, out))
            except Exception as e:  # surfaces to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _first_or_error(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pulls the first chunk before the response starts, so early errors become 4xx, not a broken stream."""
        first = await gen.__anext__()

        async def rest() -> AsyncIterator[str]:
            yield first
            async for chunk in gen:
                yield chunk

        return rest()

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request, body: dict):
        self.check_model(body)
        messages, images, videos, audios = parse_chat_messages(body.get("messages"))
        try:
            prompt = self.tm.info.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # jinja errors on odd message orders are user input errors
            raise APIError(f"messages: the chat template rejected the conversation ({e})", param="messages") from None
        sp = sampling_params_from_openai(body, default_max_tokens=1 << 20)  # replaced once the prompt length is known
        base = dict(text=prompt, image_data=images or None, video_data=videos or None, audio_data=audios or None,
                    return_logprob=bool(sp.logprobs), stream=bool(body.get("stream")),
                    auto_max_new_tokens=body.get("max_tokens") is None and body.get("max_completion_tokens") is None)
        reqs = self._fan_out(base, sp)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            gen = self._chat_stream(reqs, rid, created, include_usage)
            return StreamingResponse(await self._first_or_error(gen), media_type="text/event-stream")
        outs = await self._collect_all(request, reqs)
        choices = []
        for i, out in enumerate(outs):
            choice = {"index": i, "message": {"role": "assistant", "content": out["text"]},
                      "logprobs": self._chat_logprobs(out) if sp.logprobs else None,
                      "finish_reason": _finish_reason(out["meta_info"])}
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage([o["meta_info"] for o in outs])})

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text = self.tm.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat_logprobs(self, out: dict, start: int = 0) -> dict:
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        content = []
        for k, (lp, tid) in enumerate(pairs):
            entry = self._token_entry(tid, lp)
            entry["top_logprobs"] = [self._token_entry(t, v) for t, v in (tops[k] if k < len(tops) else [])]
            content.append(entry)
        return {"content": content}

    async def _chat_stream(self, reqs, rid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
        def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

        for i in range(len(reqs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        metas: dict[int, dict] = {}
        sent_tokens: dict[int, int] = {}
        async for i, out in self._merged_stream(reqs):
            meta = out["meta_info"]
            lp = None
            if reqs[i].return_logprob:
                lp = self._chat_logprobs(out, sent_tokens.get(i, 0))
                sent_tokens[i] = len(meta.get("output_token_logprobs", []))
            finish = _finish_reason(meta)
            if out["delta"] or lp:
                yield chunk(i, {"content": out["delta"]}, None, lp)
            if finish is not None:
                metas[i] = meta
                yield chunk(i, {}, finish)
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [], "usage": _usage([metas[i] for i in sorted(metas)])})
        yield _sse("[DONE]")

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request, body: dict):
        self.check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [dict(text=prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [dict(input_ids=prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [dict(text=p) for p in prompt]
        else:
            raise APIError("prompt: must be a string, a list of strings or a list of token ids", param="prompt")
        sp = sampling_params_from_openai(body, default_max_tokens=16)
        echo = bool(body.get("echo"))
        reqs: list[GenerateRequest] = []
        for p in prompts:
            reqs += self._fan_out(dict(**p, return_logprob=bool(sp.logprobs), stream=bool(body.get("stream"))), sp)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            gen = self._completion_stream(reqs, rid, created, include_usage)
            return StreamingResponse(await self._first_or_error(gen), media_type="text/event-stream")
        outs = await self._collect_all(request, reqs)
        choices = []
        for i, (r, out) in enumerate(zip(reqs, outs)):
            text = ((r.text or "") if echo else "") + out["text"]
            choices.append({"index": i, "text": text, "logprobs": self._completion_logprobs(out) if sp.logprobs else None,
                            "finish_reason": _finish_reason(out["meta_info"])})
        metas = [o["meta_info"] for o in outs]
        usage = _usage(metas)
        usage["prompt_tokens"] = sum(m["prompt_tokens"] for m in metas[:: max(1, sp.n)])
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": usage})

    def _completion_logprobs(self, out: dict, start: int = 0) -> dict:
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        tokens = [self.tm.tokenizer.decode([t]) for _, t in pairs]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs],
                "top_logprobs": [{self.tm.tokenizer.decode([t]): v for t, v in top} for top in tops] or None,
                "text_offset": []}

    async def _completion_stream(self, reqs, rid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
        metas: dict[int, dict] = {}
        async for i, out in self._merged_stream(reqs):
            finish = _finish_reason(out["meta_info"])
            if out["delta"] or finish:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [{"index": i, "text": out["delta"], "logprobs": None, "finish_reason": finish}]})
            if finish is not None:
                metas[i] = out["meta_info"]
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [], "usage": _usage([metas[i] for i in sorted(metas)])})
        yield _sse("[DONE]")

    # ---- native /generate ---------------------------------------------------------------------
    async def generate(self, request: Request, body: dict):
        allowed = {"text", "input_ids", "sampling_params", "image_data", "video_data", "audio_data", "stream",
                   "return_logprob", "rid"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise APIError(f"{unknown[0]}: unknown field (accepted: {', '.join(sorted(allowed))})", param=unknown[0])
        sp = SamplingParams.from_dict(body.get("sampling_params") or {})
        base = dict(text=body.get("text"), input_ids=body.get("input_ids"), image_data=body.get("image_data"),
                    video_data=body.get("video_data"), audio_data=body.get("audio_data"),
                    return_logprob=bool(body.get("return_logprob")), stream=bool(body.get("stream")))
        reqs = self._fan_out(base, sp)
        if body.get("rid") and len(reqs) == 1:
            reqs[0].rid = str(body["rid"])
        if body.get("stream"):
            async def gen() -> AsyncIterator[str]:
                async for _, out in self._merged_stream(reqs):
                    yield _sse(out)
                yield _sse("[DONE]")

            return StreamingResponse(await self._first_or_error(gen()), media_type="text/event-stream")
        outs = await self._collect_all(request, reqs)
        return JSONResponse(outs[0] if len(outs) == 1 else outs)
