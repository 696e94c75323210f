"""OpenAI chat/completions handlers over the TokenizerManager.

Every request is validated and tokenized (media loaded) before its response starts, so input errors
are 4xx responses, never a stream that breaks after its first byte. An error after the first byte
(the scheduler died) goes out as an SSE event in OpenAI's error shape, followed by [DONE].
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.entrypoints.openai.errors import APIError, public_message
from tessera.entrypoints.openai.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    StreamOptions,
    check_fields,
    parse_chat_messages,
    renamed_error,
    sampling_params_from_openai,
    stream_options,
    user_names,
)
from tessera.entrypoints.openai.tool_calls import (
    ToolCallParser,
    ToolPlan,
    forced_calls,
    parse_tool_calls,
    plan_tools,
    stream_deltas,
)
from tessera.frontend.request import GenerateRequest
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.sampling_params import SamplingParams
from tessera.scheduler.io import TokenizedGenerateReq

logger = logging.getLogger("tessera.server")
MAX_N = 128  # choices per request, as OpenAI's API allows
MAX_BATCH = 1024  # prompts in one batched request (/v1/completions, /generate): each becomes a request


def check_batch(size: int, param: str) -> None:
    if size > MAX_BATCH:
        raise APIError(f"{param}: at most {MAX_BATCH} prompts in one request, got {size}", param=param)
DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its generations were aborted (nobody to answer)."""


def finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(fr["type"], fr["type"])


def matched_stop(meta: dict):
    """SGLang's matched_stop: the stop string or token id that ended the choice (None otherwise)."""
    fr = meta.get("finish_reason") or {}
    return fr.get("matched") if fr.get("type") == "stop" else None


def usage_of(metas: list[dict], prompts: int = 1) -> dict:
    """Usage of the choices' metas; the prompt is counted once per distinct prompt (n samples share it)."""
    step = max(1, len(metas) // max(1, prompts))
    prompt = sum(m["prompt_tokens"] for m in metas[::step])
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas[::step])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(gen: AsyncIterator[str]) -> StreamingResponse:
    """The SSE response of gen; an exception after the first byte becomes an error event, then [DONE]."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:  # noqa: BLE001 -- the status line is sent: the error must travel in-band
            public = isinstance(e, APIError) or getattr(e, "public", False)
            if public:
                logger.warning("stream failed after it started: %s", e)
            else:
                logger.exception("stream failed after it started")
            status = getattr(e, "status", 500)
            message = public_message(str(e)) if public else "internal server error (details in the server log)"
            err = APIError(message, status, getattr(e, "param", None))
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}})
            yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream")


@dataclass
class ChunkWriter:
    """SSE chunks of one streamed response (chat.completion.chunk or text_completion)."""

    rid: str
    created: int
    model: str
    object: str
    opts: StreamOptions
    prompt_lens: list[int]  # each choice's prompt tokens, for usage before its first token

    def __call__(self, i: int, choice: dict, finish: str | None = None, logprobs=None, meta: dict | None = None) -> str:
        choice = {"index": i, **choice, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched_stop(meta or {})
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.opts.continuous_usage:  # every chunk, before the first token too (vLLM's continuous_usage_stats)
            body["usage"] = usage_of([meta or {"prompt_tokens": self.prompt_lens[i], "completion_tokens": 0}])
        return sse(body)

    def end(self, metas: dict[int, dict], prompts: int = 1) -> Iterator[str]:
        """The usage chunk (when asked for) and [DONE]."""
        if self.opts.include_usage:
            yield sse({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_of([metas[i] for i in sorted(metas)], prompts)})
        yield sse("[DONE]")


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm, self.model_name = tm, model_name
        info = tm.info
        proc_template = getattr(info.hf_processor, "chat_template", None) if info.hf_processor is not None else None
        self.chat_template = proc_template or getattr(info.tokenizer, "chat_template", None)

    # ---- helpers ------------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name not in (None, "", "default", self.model_name, self.tm.args.model_path):
            raise APIError(f"model: the model {name!r} does not exist; this server serves {self.model_name!r}",
                           status=404, param="model")

    def fan_out(self, base: dict, sp: SamplingParams) -> list[GenerateRequest]:
        # n is checked before it sizes anything: a huge n would otherwise build that many requests first.
        if isinstance(sp.n, bool) or not isinstance(sp.n, int) or not 1 <= sp.n <= MAX_N:
            raise APIError(f"n: must be an integer in [1, {MAX_N}], got {sp.n!r}", param="n")
        reqs = []
        for i in range(sp.n):
            seed = None if sp.seed is None else sp.seed + i
            params = SamplingParams(**{**sp.__dict__, "n": 1, "seed": seed})
            reqs.append(GenerateRequest(sampling_params=params, **base))
        return reqs

    async def prepare(self, reqs: list[GenerateRequest], names: dict[str, str]) -> list[TokenizedGenerateReq]:
        """Validates and tokenizes every request before anything is sent (or any byte answered)."""
        try:
            return list(await asyncio.gather(*(self.tm.tokenize(r) for r in reqs)))
        except ValueError as e:
            raise renamed_error(e, names) from None

    async def collect_all(self, request: Request, reqs: list[GenerateRequest],
                          tokenized: list[TokenizedGenerateReq]) -> list[dict]:
        """Runs the requests to completion; aborts them all if the client disconnects."""

        async def one(r: GenerateRequest, t: TokenizedGenerateReq) -> dict:
            out = None
            async for out in self.tm.generate(r, t):
                pass
            return out

        task = asyncio.ensure_future(asyncio.gather(*(one(r, t) for r, t in zip(reqs, tokenized))))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()  # each generate()'s finally sends AbortReq, freeing the KV
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                raise ClientDisconnected(request.url.path)

    async def _collect_all(self, request: Request, reqs: list[GenerateRequest]) -> list[dict]:
        """prepare + collect_all, for the transcription endpoints."""
        return await self.collect_all(request, reqs, await self.prepare(reqs, {}))

    async def _first_or_error(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pulls the first chunk before the response starts, so errors that come before it are 4xx
        (the transcription stream tokenizes as it goes)."""
        first = await gen.__anext__()

        async def rest() -> AsyncIterator[str]:
            yield first
            async for chunk in gen:
                yield chunk

        return rest()

    async def merged_stream(self, reqs: list[GenerateRequest],
                            tokenized: list[TokenizedGenerateReq]) -> AsyncIterator[tuple[int, dict]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, r: GenerateRequest, t: TokenizedGenerateReq) -> None:
            try:
                async for out in self.tm.generate(r, t):
                    await queue.put((i, out))
            except Exception as e:  # surfaces to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.ensure_future(pump(i, r, t)) for i, (r, t) in enumerate(zip(reqs, tokenized))]
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

    def _token_text(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id])

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    # ---- /v1/chat/completions -----------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], body: dict, plan: ToolPlan | None) -> str:
        cont = body.get("continue_final_message", False)
        # SGLang's clients send only continue_final_message (a prefilled answer): no new turn then.
        add_gen = body.get("add_generation_prompt", cont is not True)
        for name, value in (("add_generation_prompt", add_gen), ("continue_final_message", cont)):
            if not isinstance(value, bool):
                raise APIError(f"{name}: must be a boolean", param=name)
        if cont and add_gen:
            raise APIError("continue_final_message: cannot be combined with add_generation_prompt true",
                           param="continue_final_message")
        if cont and messages[-1]["role"] != "assistant":
            raise APIError("continue_final_message: the last message must be the assistant's",
                           param="continue_final_message")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise APIError("chat_template_kwargs: must be an object", param="chat_template_kwargs")
        reserved = sorted(set(extra) & {"messages", "conversation", "tools", "add_generation_prompt",
                                        "continue_final_message", "tokenize", "chat_template"})
        if reserved:
            raise APIError(f"chat_template_kwargs: {reserved[0]!r} is set by the request itself",
                           param="chat_template_kwargs")
        if plan is not None:
            extra = {**extra, "tools": plan.tools}
        try:
            prompt = self.tm.info.apply_chat_template(messages, add_generation_prompt=add_gen,
                                                      continue_final_message=cont, **extra)
        except Exception as e:  # jinja errors on odd message orders are user input errors
            raise APIError(f"messages: the chat template rejected the conversation ({e})", param="messages") from None
        return prompt + (plan.forced_prefix if plan is not None else "")

    async def chat(self, request: Request, body: dict):
        check_fields(body, CHAT_FIELDS)
        self.check_model(body)
        opts = stream_options(body)
        messages, images, videos, audios = parse_chat_messages(body.get("messages"))
        plan = plan_tools(body, self.chat_template)
        prompt = self.chat_prompt(messages, body, plan)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise APIError("echo: must be a boolean", param="echo")
        # vLLM's chat echo: the reply starts with the last message when that one is the assistant's own.
        last = messages[-1]
        echo_text = ""
        if echo and last["role"] == "assistant":
            echo_text = last["content"] if isinstance(last["content"], str) else "".join(
                p.get("text", "") for p in last["content"])
        sp = sampling_params_from_openai(body, default_max_tokens=1 << 20, vocab_size=self.tm.info.vocab_size)
        if plan is not None and plan.call_schema() is not None:
            if sp.json_schema or sp.regex or sp.ebnf:
                raise APIError("tool_choice: a required or named tool call cannot be combined with response_format, "
                               "regex, ebnf or json_schema", param="tool_choice")
            sp.json_schema = plan.call_schema()
            try:
                sp.verify(self.tm.info.vocab_size)
            except ValueError as e:  # a tool's parameters are not a schema the grammar compiler takes
                raise APIError(f"tools: a function's parameters are not a usable JSON schema ({e})",
                               param="tools") from None
        base = dict(text=prompt, image_data=images or None, video_data=videos or None, audio_data=audios or None,
                    return_logprob=bool(sp.logprobs), stream=opts.stream, cache_salt=cache_salt_of(body),
                    auto_max_new_tokens=body.get("max_tokens") is None and body.get("max_completion_tokens") is None)
        base.update(video_kwargs_of(body))
        reqs = self.fan_out(base, sp)
        tokenized = await self.prepare(reqs, user_names(body, chat=True))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if opts.stream:
            return event_stream(self._chat_stream(reqs, tokenized, rid, created, opts, plan, echo_text))
        outs = await self.collect_all(request, reqs, tokenized)
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            message: dict = {"role": "assistant", "content": echo_text + out["text"]}
            finish = finish_reason(meta)
            if plan is not None:
                content, calls = parse_tool_calls(plan.forced_prefix + out["text"], plan)
                message["content"] = (echo_text + content) if content is not None else (echo_text or None)
                if calls:
                    message["tool_calls"] = calls
                    if finish == "stop" and plan.choice != "named":
                        finish = "tool_calls"
            choices.append({"index": i, "message": message,
                            "logprobs": self._chat_logprobs(out) if sp.logprobs else None,
                            "finish_reason": finish, "matched_stop": matched_stop(meta)})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": usage_of([o["meta_info"] for o in outs])})

    def _chat_logprobs(self, out: dict, start: int = 0) -> dict:
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        content = []
        for k, (lp, tid) in enumerate(pairs):
            entry = self._token_entry(tid, lp)
            entry["top_logprobs"] = [self._token_entry(t, v) for v, t in (tops[k] if k < len(tops) else [])]
            content.append(entry)
        return {"content": content}

    async def _chat_stream(self, reqs, tokenized, rid: str, created: int, opts: StreamOptions,
                           plan: ToolPlan | None, echo_text: str) -> AsyncIterator[str]:
        writer = ChunkWriter(rid, created, self.model_name, "chat.completion.chunk", opts,
                             [len(t.input_ids) for t in tokenized])

        def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None, meta: dict | None = None) -> str:
            return writer(i, {"delta": delta}, finish, logprobs, meta)

        parsers = {}
        for i in range(len(reqs)):
            yield chunk(i, {"role": "assistant", "content": ""})
            if echo_text:
                yield chunk(i, {"content": echo_text})
            if plan is not None:
                parsers[i] = ToolCallParser()
                parsers[i].feed(plan.forced_prefix)
        metas: dict[int, dict] = {}
        sent_tokens: dict[int, int] = {}
        num_calls: dict[int, int] = {}
        async for i, out in self.merged_stream(reqs, tokenized):
            meta = out["meta_info"]
            lp = None
            if reqs[i].return_logprob:
                lp = self._chat_logprobs(out, sent_tokens.get(i, 0))
                sent_tokens[i] = len(meta.get("output_token_logprobs", []))
                lp = lp if lp["content"] else None
            finish = finish_reason(meta)
            content, calls = out["delta"], []
            if plan is not None:
                content, calls = parsers[i].feed(content)
                if finish is not None:
                    tail, more = parsers[i].finish()
                    forced = forced_calls(plan, parsers[i], out["text"])
                    # a forced call cut short: its text is the call's, not content
                    content, calls = (content, forced) if forced else (content + tail, calls + more)
                    if not plan.parallel:
                        calls = calls[:max(0, 1 - num_calls.get(i, 0))]
            delta: dict = {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = stream_deltas(calls, num_calls.get(i, 0))
                num_calls[i] = num_calls.get(i, 0) + len(calls)
            if delta or lp:
                yield chunk(i, delta, None, lp, meta)
            if finish is not None:
                metas[i] = meta
                if finish == "stop" and num_calls.get(i) and plan is not None and plan.choice != "named":
                    finish = "tool_calls"
                yield chunk(i, {}, finish, None, meta)
        for tail in writer.end(metas):
            yield tail

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request, body: dict):
        check_fields(body, COMPLETION_FIELDS)
        self.check_model(body)
        opts = stream_options(body)
        prompts = prompts_of(body.get("prompt"))
        check_batch(len(prompts), "prompt")
        sp = sampling_params_from_openai(body, default_max_tokens=16, vocab_size=self.tm.info.vocab_size, chat=False)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise APIError("echo: must be a boolean", param="echo")
        if echo and sp.logprobs:
            raise APIError("echo: with logprobs it needs prompt logprobs, which Tessera does not compute",
                           param="echo")
        reqs: list[GenerateRequest] = []
        echoes: list[str] = []
        for p in prompts:
            new = self.fan_out(dict(**p, return_logprob=bool(sp.logprobs), stream=opts.stream,
                                    cache_salt=cache_salt_of(body)), sp)
            reqs += new
            text = p.get("text")
            if echo and text is None:
                text = self.tm.tokenizer.decode(p["input_ids"])
            echoes += [text if echo else ""] * len(new)
        tokenized = await self.prepare(reqs, user_names(body, chat=False))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if opts.stream:
            return event_stream(self._completion_stream(reqs, tokenized, rid, created, opts, echoes, len(prompts)))
        outs = await self.collect_all(request, reqs, tokenized)
        choices = []
        for i, out in enumerate(outs):
            choices.append({"index": i, "text": echoes[i] + out["text"],
                            "logprobs": self._completion_logprobs(out, 0, len(echoes[i])) if sp.logprobs else None,
                            "finish_reason": finish_reason(out["meta_info"]),
                            "matched_stop": matched_stop(out["meta_info"])})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": usage_of([o["meta_info"] for o in outs], len(prompts))})

    def _completion_logprobs(self, out: dict, start: int, offset: int) -> dict:
        """OpenAI's legacy logprobs for output tokens [start:]: each top_logprobs entry holds the
        `logprobs` most likely tokens and the sampled one (so logprobs=0 still gives one entry)."""
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs", [])[start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        tokens = [self._token_text(t) for _, t in pairs]
        top_logprobs, text_offset = [], []
        for k, (lp, tid) in enumerate(pairs):
            entry = {self._token_text(t): v for v, t in (tops[k] if k < len(tops) else [])}
            entry.setdefault(tokens[k], lp)
            top_logprobs.append(entry)
            text_offset.append(offset)
            offset += len(tokens[k])
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    async def _completion_stream(self, reqs, tokenized, rid: str, created: int, opts: StreamOptions,
                                 echoes: list[str], num_prompts: int) -> AsyncIterator[str]:
        writer = ChunkWriter(rid, created, self.model_name, "text_completion", opts,
                             [len(t.input_ids) for t in tokenized])

        def chunk(i: int, text: str, finish: str | None = None, logprobs=None, meta: dict | None = None) -> str:
            return writer(i, {"text": text}, finish, logprobs, meta)

        for i, text in enumerate(echoes):
            if text:
                yield chunk(i, text)
        metas: dict[int, dict] = {}
        sent_tokens: dict[int, int] = {}
        offsets = {i: len(text) for i, text in enumerate(echoes)}
        async for i, out in self.merged_stream(reqs, tokenized):
            meta = out["meta_info"]
            finish = finish_reason(meta)
            lp = None
            if reqs[i].return_logprob:
                lp = self._completion_logprobs(out, sent_tokens.get(i, 0), offsets[i])
                sent_tokens[i] = len(meta.get("output_token_logprobs", []))
                offsets[i] += sum(len(t) for t in lp["tokens"])
            if out["delta"] or finish or (lp and lp["tokens"]):
                yield chunk(i, out["delta"], finish, lp, meta)
            if finish is not None:
                metas[i] = meta
        for tail in writer.end(metas, num_prompts):
            yield tail


def prompts_of(prompt) -> list[dict]:
    """A completions prompt: a string, a list of strings, a list of token ids or a list of such lists."""
    def is_ids(p) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) and prompt:
        return [dict(text=prompt)]
    if is_ids(prompt):
        return [dict(input_ids=prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
        return [dict(text=p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        return [dict(input_ids=p) for p in prompt]
    raise APIError("prompt: must be a non-empty string, a list of strings, a list of token ids or a list of "
                   "token-id lists", param="prompt")


def cache_salt_of(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError("cache_salt: must be a non-empty string", param="cache_salt")
    return salt


def video_kwargs_of(body: dict) -> dict:
    """vLLM's per-request media_io_kwargs: {"video": {"num_frames": N}} (also fps, max_frames)."""
    kw = body.get("media_io_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or set(kw) - {"video"}:
        raise APIError("media_io_kwargs: only {\"video\": {...}} is supported", param="media_io_kwargs")
    video = kw.get("video") or {}
    if not isinstance(video, dict):
        raise APIError("media_io_kwargs.video: must be an object", param="media_io_kwargs")
    unknown = sorted(set(video) - {"num_frames", "fps", "max_frames"})
    if unknown:
        raise APIError(f"media_io_kwargs.video.{unknown[0]}: unknown option (num_frames, fps, max_frames)",
                       param="media_io_kwargs")
    for name, value in video.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise APIError(f"media_io_kwargs.video.{name}: must be a positive number", param="media_io_kwargs")
        if name != "fps" and not isinstance(value, int):
            raise APIError(f"media_io_kwargs.video.{name}: must be an integer", param="media_io_kwargs")
    return {"video_kwargs": video} if video else {}
