"""OpenAI's Responses API in terms of chat: a request's `input` items, `instructions`, tools and text format as a
chat completion's body, a chat completion's message as the Responses `output` items, and the bounded store of
responses that `previous_response_id` continues from."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from tessera.entrypoints.openai.errors import APIError

STORE_SIZE = 1024  # responses kept for previous_response_id (oldest dropped first)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses: id -> (the conversation as chat messages, ending with the response's own turn,
    the response object). In memory, bounded; a response asked with store: false is not kept."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self.items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        self.items[response_id] = (messages, response)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict]:
        if response_id not in self.items:
            raise APIError(f"previous_response_id: no stored response {response_id!r} (responses are kept in "
                           f"memory, the last {self.size}, and only with store true)", status=404,
                           param="previous_response_id")
        return list(self.items[response_id][0])

    def get(self, response_id: str) -> dict:
        if response_id not in self.items:
            raise APIError(f"response {response_id!r} not found", status=404, param="response_id")
        return self.items[response_id][1]


def _part(part: Any, where: str) -> dict:
    """One Responses content part as a chat content part."""
    if not isinstance(part, dict):
        raise APIError(f"{where}: each content part is an object with a type", param="input")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise APIError(f"{where}.image_url: an image URL or data URI (file ids are not supported)",
                           param="input")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "input_file":
        data = part.get("file_data") or part.get("file_url")
        if isinstance(data, str) and data.startswith("data:image/"):
            return {"type": "image_url", "image_url": {"url": data}}
        if isinstance(data, str) and part.get("file_url") and (part.get("filename") or data).lower().endswith(
                (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")):
            return {"type": "image_url", "image_url": {"url": data}}
        raise APIError(f"{where}: input_file is taken as an image only (a data:image/... file_data or an image "
                       f"file_url); other files are not supported", param="input")
    raise APIError(f"{where}.type: unsupported content part {kind!r} (input_text, input_image, input_file)",
                   param="input")


def chat_messages(items: str | list, instructions: str | None) -> list[dict]:
    """`input` (a string, or items: messages, function_call, function_call_output) as chat messages."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where}: each input item is an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
            messages.append({"role": item.get("role", "user"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else str(output)})
        elif kind == "reasoning":
            continue  # a model's earlier thinking is not sent back to it
        else:
            raise APIError(f"{where}.type: unsupported input item {kind!r} (message, function_call, "
                           f"function_call_output)", param="input")
    return messages


def chat_tools(tools: list | None, tool_choice: Any) -> tuple[list | None, Any]:
    """Responses function tools and tool_choice in chat's shape; other tool types are refused."""
    if not tools:
        return None, None if tool_choice in (None, "auto", "none") else tool_choice
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise APIError(f"tool_choice: {tool_choice.get('type')!r} is not supported (auto, none, required or "
                           f"a function)", param="tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return out, tool_choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise APIError(f"text.format.type: {fmt.get('type')!r} (text, json_object or json_schema)", param="text")


def output_items(message: dict) -> list[dict]:
    """A chat message (content, reasoning, tool_calls) as Responses output items, in that order."""
    items: list[dict] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
