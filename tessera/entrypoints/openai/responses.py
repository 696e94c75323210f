"""/v1/responses: OpenAI's Responses API over the chat path (chat.py), so everything a chat request can do a
response does: images, tools, constrained JSON, reasoning. The request becomes a chat body (responses_items.py),
the chat answer becomes `output` items; streamed, the chat chunks become the Responses events
(response.created ... response.output_text.delta ... response.completed). Responses are kept in memory (the
last 1024, not those asked with store: false) for `previous_response_id` and GET /v1/responses/{id}.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from tessera.entrypoints.openai.chat import create_chat_completion
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.request_models import REQUEST_BODIES, ChatCompletionRequest, _Body, parse
from tessera.entrypoints.openai.response_models import RESPONSES, _Answer
from tessera.entrypoints.openai.responses_items import (
    ResponseStore,
    chat_messages,
    chat_tools,
    message_item,
    new_id,
    output_items,
    response_format,
    usage,
)
from tessera.entrypoints.openai.serving import OpenAIServing
from tessera.entrypoints.openai.streaming import event_stream


class ResponsesRequest(_Body):
    """OpenAI's Responses request (the fields a chat model can honour)."""

    model: str | None = Field(None, description="The served model's name; optional.")
    input: str | list[dict[str, Any]] = Field(description="A string, or items: messages (input_text, input_image, "
                                                          "input_file as an image), function_call, "
                                                          "function_call_output.")
    instructions: str | None = Field(None, description="A system message in front of the input (not carried over "
                                                       "by previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a stored response.")
    max_output_tokens: int | None = Field(None, description="Most new tokens.")
    temperature: float | None = Field(None, description="Sampling temperature.")
    top_p: float | None = Field(None, description="Nucleus sampling mass.")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto, none, required or a function.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one answer.")
    max_tool_calls: int | None = Field(None, description="Accepted; one model turn makes the calls it makes.")
    text: dict[str, Any] | None = Field(None, description="`{format: {type: text | json_object | json_schema}}`.")
    stream: bool | None = Field(False, description="Stream the Responses events.")
    stream_options: dict[str, Any] | None = Field(None, description="Accepted.")
    store: bool | None = Field(True, description="Keep the response for previous_response_id (default true).")
    metadata: dict[str, str] | None = Field(None, description="Returned with the response.")
    user: str | None = Field(None, description="Accepted, changes nothing.")
    safety_identifier: str | None = Field(None, description="Accepted, changes nothing.")
    prompt_cache_key: str | None = Field(None, description="Accepted: the radix cache reuses any shared prefix.")
    service_tier: Literal["auto", "default"] | None = Field(None, description="There is one tier.")
    truncation: Literal["disabled"] | None = Field(None, description="Input is never truncated.")
    reasoning: dict[str, Any] | None = Field(None, description="Accepted; thinking is the model's own "
                                                               "(--reasoning-parser splits it out).")
    include: list[str] | None = Field(None, description="Accepted.")
    top_logprobs: int | None = Field(None, description="Not supported beyond 0.")
    background: Literal[False] | None = Field(None, description="Background responses are not supported.")


class ResponseObject(_Answer):
    """OpenAI's response object."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(description="message, function_call and reasoning items, in order.")
    usage: dict[str, Any] | None = Field(description="input_tokens, output_tokens, total_tokens and details.")
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None = Field(description="{reason: max_output_tokens} when cut short.")
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    store: bool
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    user: str | None


class ResponseEvent(_Answer):
    """One streamed event (`event: <type>` and its data): response.created, response.output_text.delta, ..."""

    type: str
    sequence_number: int


REQUEST_BODIES["/v1/responses"] = (ResponsesRequest, "application/json")
RESPONSES["/v1/responses"] = (ResponseObject, ResponseEvent)
STORE = ResponseStore()


def _chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    if req.top_logprobs:
        raise APIError("top_logprobs: log-probabilities are not returned by /v1/responses", param="top_logprobs")
    tools, tool_choice = chat_tools(req.tools, req.tool_choice)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {"model": req.model, "messages": system + messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
            "stream": bool(req.stream), "stream_options": {"include_usage": True} if req.stream else None}
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def _response(req: ResponsesRequest, rid: str, created: int, model: str, output: list[dict], status: str,
              chat_usage: dict | None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id":
            req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "store": req.store is not False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
            "usage": usage(chat_usage), "user": req.user}


def _assistant_turn(output: list[dict]) -> dict:
    """The response's output as the chat message that continues its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


async def create_response(serving: OpenAIServing, request: Request, req: ResponsesRequest):
    history = STORE.conversation(req.previous_response_id) if req.previous_response_id else []
    messages = history + chat_messages(req.input, None)
    chat_req = _chat_request(req, messages)
    rid, created = new_id("resp"), int(time.time())
    answer = await create_chat_completion(serving, request, chat_req)
    model = serving.answer_model(serving.check_model(chat_req.model, chat_req.lora_path), chat_req.model)
    if req.stream:
        return event_stream(_events(req, answer.body_iterator, rid, created, model, messages))
    chat = json.loads(answer.body)
    choice = chat["choices"][0]
    output = output_items(choice["message"])
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    response = _response(req, rid, created, chat["model"], output, status, chat["usage"])
    if req.store is not False:
        STORE.put(rid, messages + [_assistant_turn(output)], response)
    return JSONResponse(response)


def get_response(response_id: str) -> dict:
    return STORE.get(response_id)


class _Events:
    """The Responses events of one streamed answer, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the message or function_call item receiving deltas

    def __call__(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def add(self, item: dict) -> list[str]:
        out = self.close()
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        out.append(self("response.output_item.added", output_index=index, item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            out.append(self("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self.output.index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]))
            out.append(self("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=part))
        elif item["type"] == "function_call":
            out.append(self("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]))
        out.append(self("response.output_item.done", output_index=index, item=item))
        return out


async def _events(req: ResponsesRequest, chunks: AsyncIterator, rid: str, created: int, model: str,
                  messages: list[dict]) -> AsyncIterator[str]:
    ev = _Events()
    yield ev("response.created", response=_response(req, rid, created, model, [], "in_progress", None))
    yield ev("response.in_progress", response=_response(req, rid, created, model, [], "in_progress", None))
    finish, chat_usage, reasoning = None, None, ""
    async for raw in chunks:
        data = raw.removeprefix("data: ").strip() if isinstance(raw, str) else raw.decode().removeprefix("data: ")
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            yield ev("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))
            yield ev("response.failed", response={**_response(req, rid, created, model, ev.output, "failed", None),
                                                  "error": {"code": "server_error", "message": err.get("message")}})
            return
        chat_usage = chunk.get("usage") or chat_usage
        for choice in chunk.get("choices") or []:
            delta, finish = choice.get("delta") or {}, choice.get("finish_reason") or finish
            reasoning += delta.get("reasoning_content") or ""
            if delta.get("content"):
                if ev.open is None or ev.open["type"] != "message":
                    for line in ev.add(message_item("", item_id=new_id("msg"))):
                        yield line
                item = ev.open
                item["content"][0]["text"] += delta["content"]
                yield ev("response.output_text.delta", item_id=item["id"], output_index=len(ev.output) - 1,
                         content_index=0, delta=delta["content"], logprobs=[])
            for tc in delta.get("tool_calls") or []:
                if tc.get("id"):  # a call's header: a new function_call item
                    item = {"type": "function_call", "id": new_id("fc"), "call_id": tc["id"],
                            "name": tc["function"]["name"], "arguments": "", "status": "completed"}
                    for line in ev.add(item):
                        yield line
                elif ev.open is not None and ev.open["type"] == "function_call":
                    args = tc.get("function", {}).get("arguments") or ""
                    ev.open["arguments"] += args
                    yield ev("response.function_call_arguments.delta", item_id=ev.open["id"],
                             output_index=len(ev.output) - 1, delta=args)
    for line in ev.close():
        yield line
    if reasoning:  # the thinking, whole, ahead of the answer it led to
        ev.output.insert(0, output_items({"reasoning_content": reasoning})[0])
    status = "incomplete" if finish == "length" else "completed"
    response = _response(req, rid, created, model, ev.output, status, chat_usage)
    if req.store is not False:
        STORE.put(rid, messages + [_assistant_turn(ev.output)], response)
    yield ev(f"response.{status}", response=response)
