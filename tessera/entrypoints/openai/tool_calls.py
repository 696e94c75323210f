"""Tool calling for chat templates in the Hermes/Qwen format: tools go to the template, the model
answers `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the parser turns that into
OpenAI `tool_calls` (whole, or as streamed deltas).

tool_choice: "none" renders no tools (the model cannot call one); "auto" lets the model choose;
"required" and a named function start the assistant turn with "<tool_call>" and constrain what follows
(constrained decoding, a JSON schema) to {"name": one of the tools (or the named one), "arguments": that
function's parameters}, so the answer is a valid call. Templates without tool support, or whose call
format is not this one, get a 400 naming `tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tessera.entrypoints.openai.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_supports_tools(template: Any) -> bool:
    """True for a chat template that renders `tools` and uses the <tool_call> format."""
    if isinstance(template, dict):  # named templates: the one that renders tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template and OPEN in template


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # OpenAI tool objects, for the template
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the forced function (choice == "named")
    parallel: bool = True

    @property
    def forced_prefix(self) -> str:
        """Text that opens the assistant turn (it is part of the prompt, and of the parsed answer)."""
        return f"{OPEN}\n" if self.choice in ("required", "named") else ""

    def call_schema(self) -> str | None:
        """The JSON schema the answer must follow after forced_prefix (None for "auto")."""
        if self.choice == "auto":
            return None
        options = []
        for tool in self.tools:
            fn = tool["function"]
            if self.choice == "named" and fn["name"] != self.name:
                continue
            options.append({"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}}})
        return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def plan_tools(req, template: Any) -> ToolPlan | None:
    """The chat request's tools and tool_choice, validated; None when no tool may be called."""
    tools, choice = req.tools, req.tool_choice
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice: requires tools", param="tool_choice")
        return None
    if not tools:
        raise APIError("tools: must be a non-empty list", param="tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}].function.name: must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters: must be a JSON schema object", param="tools")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError("tool_choice: must be none, auto, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")
        if fn["name"] not in names:
            raise APIError(f"tool_choice: function {fn['name']!r} is not among the tools", param="tool_choice")
        choice, name = "named", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise APIError(f"tool_choice: unknown value {choice!r} (none, auto, required or a named function)",
                       param="tool_choice")
    if choice == "none":
        return None
    if not template_supports_tools(template):
        raise APIError("tools: this model's chat template has no tool support in the <tool_call> format "
                       "(pass --chat-template with one, or send tool_choice \"none\")", param="tools")
    return ToolPlan([t if "type" in t else {"type": "function", **t} for t in tools], choice, name,
                    req.parallel_tool_calls is not False)


def _call(payload: str) -> dict | None:
    """An OpenAI tool call from the JSON inside <tool_call>...</tool_call>; None if it is not one."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


@dataclass
class ToolCallParser:
    """Splits model text into content and tool calls, incrementally.

    `feed(delta)` returns (content delta, calls completed by it); `finish()` flushes the rest: a call
    left open at the end (EOS right after its JSON) is parsed if it is valid, else returned as content.
    Content that could be the start of "<tool_call>" is held back until it cannot be.
    """

    buffer: str = ""
    in_call: bool = False
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, done = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                payload, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(CLOSE):], False
                call = _call(payload.strip())
                if call is None:  # not a call after all: the model's text, as written
                    content += OPEN + payload + CLOSE
                else:
                    done.append(call)
            else:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                                 if self.buffer.endswith(OPEN[:k])), 0)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:start]
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
        self.calls += done
        return content, done

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        call = _call(rest.strip())
        if call is None:
            return OPEN + rest, []
        self.calls.append(call)
        return "", [call]


def fallback_call(plan: ToolPlan, generated: str) -> dict | None:
    """A forced call (required/named) that max_tokens cut short: the function's name (the named one, or the
    one the model had written) and, as arguments, what the model wrote of them. The answer is a call either
    way; finish_reason "length" tells the client it is incomplete. None when not even the name was written."""
    text = generated.split(CLOSE, 1)[0]
    name = plan.name
    if name is None:
        found = re.search(r'"name"\s*:\s*"([^"]+)"', text)
        name = found.group(1) if found else None
    if name is None:
        return None
    args = text.split('"arguments":', 1)[1].strip() if '"arguments":' in text else ""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(plan: ToolPlan, parser: ToolCallParser, generated: str) -> list[dict]:
    """After parser.finish(): the forced call when the answer did not parse as one (see fallback_call)."""
    if plan.choice == "auto" or parser.calls:
        return []
    call = fallback_call(plan, generated)
    if call is not None:
        parser.calls.append(call)
    return [call] if call is not None else []


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; text starts with the plan's forced prefix."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    tail, _ = parser.finish()
    calls = parser.calls if plan.parallel else parser.calls[:1]
    forced = forced_calls(plan, parser, text[len(plan.forced_prefix):])
    if forced:
        return None, forced
    content = (content + tail).strip()
    return (content or None) if calls else content, calls


def stream_deltas(calls: list[dict], first_index: int) -> list[dict]:
    """OpenAI's streamed form of completed calls: a header (id, type, name, empty arguments), then the
    arguments, each with the call's index among this choice's calls."""
    out = []
    for k, call in enumerate(calls):
        index = first_index + k
        out.append({"index": index, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}})
        out.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
    return out
