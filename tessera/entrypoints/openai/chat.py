"""/v1/chat/completions: the chat template, tool calls, echo and the chat.completion(.chunk) answers.

The prompt is rendered and every choice tokenized (media loaded) before the response starts, so bad input
is a 4xx naming the field (see serving.prepare); tool-call text is parsed out of the replies here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.prompt_logprobs import ask_prompt_logprobs, prompt_logprobs_of, vllm_prompt_logprobs
from tessera.entrypoints.openai.protocol import (
    StreamOptions,
    parse_chat_messages,
    sampling_params_from_openai,
    stream_options,
    user_names,
)
from tessera.entrypoints.openai.reasoning import reasoning_fields, split_reasoning, splitter_for
from tessera.entrypoints.openai.request_models import ChatCompletionRequest, TokenizeRequest
from tessera.entrypoints.openai.serving import OpenAIServing, response_id
from tessera.entrypoints.openai.streaming import ChunkWriter, event_stream, usage_of
from tessera.entrypoints.openai.tool_calls import (
    ToolCallParser,
    ToolPlan,
    forced_calls,
    parse_tool_calls,
    plan_tools,
    stream_deltas,
)
from tessera.frontend.result import GenerateResult


def chat_prompt(serving: OpenAIServing, messages: list[dict], req: ChatCompletionRequest | TokenizeRequest,
                plan: ToolPlan | None) -> str:
    cont = bool(req.continue_final_message)
    # SGLang's clients send only continue_final_message (a prefilled answer): no new turn then.
    add_gen = req.add_generation_prompt if req.add_generation_prompt is not None else not cont
    if cont and add_gen:
        raise APIError("continue_final_message: cannot be combined with add_generation_prompt true",
                       param="continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise APIError("continue_final_message: the last message must be the assistant's",
                       param="continue_final_message")
    extra = req.chat_template_kwargs or {}
    reserved = sorted(set(extra) & {"messages", "conversation", "tools", "add_generation_prompt",
                                    "continue_final_message", "tokenize", "chat_template"})
    if reserved:
        raise APIError(f"chat_template_kwargs: {reserved[0]!r} is set by the request itself",
                       param="chat_template_kwargs")
    if plan is not None:
        extra = {**extra, "tools": plan.tools}
    try:
        prompt = serving.tm.info.apply_chat_template(messages, add_generation_prompt=add_gen,
                                                     continue_final_message=cont, **extra)
    except Exception as e:  # jinja errors on odd message orders are user input errors
        raise APIError(f"messages: the chat template rejected the conversation ({e})", param="messages") from None
    return prompt + (plan.forced_prefix if plan is not None else "")


async def create_chat_completion(serving: OpenAIServing, request: Request, req: ChatCompletionRequest):
    lora = serving.check_model(req.model, req.lora_path)
    opts = stream_options(req)
    messages, images, videos, audios = parse_chat_messages(req.messages)
    plan = plan_tools(req, serving.chat_template, serving.tm.args.tool_call_parser)
    prompt = chat_prompt(serving, messages, req, plan)
    # A forced call starts the answer inside the call: no thinking to split off.
    reasoning_parser = None if plan is not None and plan.forced_prefix else serving.tm.args.reasoning_parser
    # vLLM's chat echo: the reply starts with the last message when that one is the assistant's own.
    last = messages[-1]
    echo_text = ""
    if req.echo and last["role"] == "assistant":
        echo_text = last["content"] if isinstance(last["content"], str) else "".join(
            p.get("text", "") for p in last["content"])
    sp = sampling_params_from_openai(req, default_max_tokens=1 << 20, vocab_size=serving.tm.info.vocab_size)
    prompt_k = prompt_logprobs_of(req.prompt_logprobs, opts.stream)
    out_top = ask_prompt_logprobs(sp, prompt_k)
    if plan is not None and plan.call_schema() is not None:
        if sp.json_schema or sp.regex or sp.ebnf:
            raise APIError("tool_choice: a required or named tool call cannot be combined with response_format, "
                           "regex, ebnf or json_schema", param="tool_choice")
        sp.json_schema = plan.call_schema()
        try:
            sp.verify(serving.tm.info.vocab_size)
        except ValueError as e:  # a tool's parameters are not a schema the grammar compiler takes
            raise APIError(f"tools: a function's parameters are not a usable JSON schema ({e})",
                           param="tools") from None
    video = (req.media_io_kwargs or {}).get("video")  # vLLM's per-request video sampling
    base = dict(text=prompt, image_data=images or None, video_data=videos or None, audio_data=audios or None,
                return_logprob=bool(sp.logprobs), stream=opts.stream, cache_salt=req.cache_salt,
                logprob_start_len=-1 if prompt_k is None else 0, prompt_logprob_ranks=prompt_k is not None,
                auto_max_new_tokens=req.max_tokens is None and req.max_completion_tokens is None,
                video_kwargs=(video.model_dump(exclude_none=True) or None) if video is not None else None,
                lora_path=lora)
    reqs = serving.fan_out(base, sp)
    tokenized = await serving.prepare(reqs, user_names(req), media_param="messages")
    rid, created = response_id("chatcmpl", request), int(time.time())
    model = serving.answer_model(lora, req.model)
    if opts.stream:
        return event_stream(_chat_stream(serving, reqs, tokenized, rid, created, opts, plan, echo_text,
                                         lambda: splitter_for(reasoning_parser, req), model))
    outs = await serving.collect_all(request, reqs, tokenized)
    extra = {}
    if prompt_k is not None:  # one list for the request: its choices share the prompt (vLLM's shape)
        extra["prompt_logprobs"] = vllm_prompt_logprobs(serving.token_text, outs[0], prompt_k)
        outs = [o.with_alternatives_cut(out_top) for o in outs]
    choices = []
    for i, out in enumerate(outs):
        reasoning, text = split_reasoning(splitter_for(reasoning_parser, req), out.text)
        message: dict = {"role": "assistant", "content": echo_text + text, **reasoning_fields(reasoning)}
        finish = out.openai_finish_reason
        if plan is not None:
            content, calls = parse_tool_calls(plan.forced_prefix + text, plan)
            message["content"] = (echo_text + content) if content is not None else (echo_text or None)
            if calls:
                message["tool_calls"] = calls
                if finish == "stop" and plan.choice != "named":
                    finish = "tool_calls"
        choices.append({"index": i, "message": message,
                        "logprobs": _chat_logprobs(serving, out) if sp.logprobs else None,
                        "finish_reason": finish, "matched_stop": out.matched_stop})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage_of(outs), **extra})


def _chat_logprobs(serving: OpenAIServing, out: GenerateResult, start: int = 0) -> dict:
    pairs, tops = out.output_logprobs[start:], out.output_tops[start:]
    content = []
    for k, (lp, tid) in enumerate(pairs):
        entry = _token_entry(serving, tid, lp)
        entry["top_logprobs"] = [_token_entry(serving, t, v) for v, t in (tops[k] if k < len(tops) else [])]
        content.append(entry)
    return {"content": content}


async def _chat_stream(serving: OpenAIServing, reqs, tokenized, rid: str, created: int, opts: StreamOptions,
                       plan: ToolPlan | None, echo_text: str, new_splitter, model: str) -> AsyncIterator[str]:
    writer = ChunkWriter(rid, created, model, "chat.completion.chunk", opts,
                         [len(t.input_ids) for t in tokenized])

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None,
              result: GenerateResult | None = None) -> str:
        return writer(i, {"delta": delta}, finish, logprobs, result)

    parsers, splitters = {}, {}
    for i in range(len(reqs)):
        yield chunk(i, {"role": "assistant", "content": ""})
        if echo_text:
            yield chunk(i, {"content": echo_text})
        if plan is not None:
            parsers[i] = ToolCallParser(plan.fmt)
            parsers[i].feed(plan.forced_prefix)
        splitters[i] = new_splitter()
    finished: dict[int, GenerateResult] = {}
    sent_tokens: dict[int, int] = {}
    num_calls: dict[int, int] = {}
    # Logprobs of tokens whose text is still held back (a partial character, a possible stop string) wait
    # for the chunk that carries their text: no chunk has neither content nor finish_reason (OpenAI's shape).
    held: dict[int, list] = {}
    async for i, out in serving.merged_stream(reqs, tokenized):
        if reqs[i].return_logprob:
            held.setdefault(i, []).extend(_chat_logprobs(serving, out, sent_tokens.get(i, 0))["content"])
            sent_tokens[i] = len(out.output_logprobs)
        finish = out.openai_finish_reason
        content, calls, reasoning = out.delta, [], ""
        if splitters[i] is not None:
            reasoning, content = splitters[i].feed(content)
            if finish is not None:
                more_reasoning, more_content = splitters[i].finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if plan is not None:
            content, calls = parsers[i].feed(content)
            if finish is not None:
                tail, more = parsers[i].finish()
                forced = forced_calls(plan, parsers[i], out.text)
                # a forced call cut short: its text is the call's, not content
                content, calls = (content, forced) if forced else (content + tail, calls + more)
                if not plan.parallel:
                    calls = calls[:max(0, 1 - num_calls.get(i, 0))]
        delta: dict = reasoning_fields(reasoning)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = stream_deltas(calls, num_calls.get(i, 0))
            num_calls[i] = num_calls.get(i, 0) + len(calls)
        if delta:
            lp = held.pop(i, None)
            yield chunk(i, delta, None, {"content": lp} if lp else None, out)
        if finish is not None:
            finished[i] = out
            if finish == "stop" and num_calls.get(i) and plan is not None and plan.choice != "named":
                finish = "tool_calls"
            lp = held.pop(i, None)
            yield chunk(i, {}, finish, {"content": lp} if lp else None, out)
    for tail in writer.end(finished):
        yield tail


def _token_entry(serving: OpenAIServing, token_id: int, logprob: float) -> dict:
    text = serving.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

