"""Tool calling: tools go to the chat template, the model answers in its family's call format
(tool_parsers.py: Hermes/Qwen `<tool_call>{...}</tool_call>`, Llama JSON or pythonic, Mistral `[TOOL_CALLS]`,
Gemma tool_code, InternLM, GLM), and the parser turns that into OpenAI `tool_calls` (whole, or streamed).

tool_choice: "none" renders no tools (the model cannot call one); "auto" lets the model choose;
"required" and a named function start the assistant turn with the format's call opener and constrain what
follows (constrained decoding, a JSON schema) to {"name": one of the tools (or the named one), "arguments": that
function's parameters}, with every number bounded (`bounded_numbers`), so the answer is a valid call that
closes. Templates without tool support get a 400 naming `tools`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.tool_parsers import (
    FORMATS,
    HERMES,
    ToolCallParser,
    ToolFormat,
    format_of_template,
    new_call,
)

__all__ = ["ToolCallParser", "ToolPlan", "bounded_numbers", "forced_calls", "parse_tool_calls", "plan_tools",
           "stream_deltas"]

# Forced calls (required / named): the text that opens the call in each JSON format, the arguments' key, and
# whether the call is a one-item list. Formats that are not JSON (pythonic, Gemma, GLM) take tool_choice auto.
_FORCED = {"hermes": ("<tool_call>\n", "arguments", False),
           "internlm": ("<|action_start|><|plugin|>\n", "parameters", False),
           "llama3": ("", "parameters", False), "llama4": ("", "parameters", False),
           "mistral": ("[TOOL_CALLS]", "arguments", True)}
# JSON numbers a forced call's grammar allows: 15 integer digits, 6 decimals. Unbounded, a small model wrote
# {"n": 555555550000... until max_tokens; bounded, the grammar itself closes the number (issue 63).
INT_BOUND, DECIMALS = 10**15 - 1, 6


def bounded_numbers(schema):
    """A copy of a JSON schema whose integers and numbers have bounds (and numbers a decimal step) where it
    gives none, so a grammar built from it cannot write digits without end. Every value it allows is valid
    against the original."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_numbers(v) if isinstance(v, (dict, list)) and k not in ("enum", "const", "required",
                                                                             "default", "examples") else v
           for k, v in schema.items()}
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -INT_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = INT_BOUND
    if "number" in types and "integer" not in types and "multipleOf" not in schema:
        out["multipleOf"] = 10 ** -DECIMALS
    return out


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # OpenAI tool objects, for the template
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the forced function (choice == "named")
    parallel: bool = True
    fmt: ToolFormat = HERMES  # how the model writes calls

    @property
    def forced_prefix(self) -> str:
        """Text that opens the assistant turn (it is part of the prompt, and of the parsed answer)."""
        return _FORCED[self.fmt.name][0] if self.choice in ("required", "named") else ""

    def call_schema(self) -> str | None:
        """The JSON schema the answer must follow after forced_prefix (None for "auto")."""
        if self.choice == "auto":
            return None
        _, key, listed = _FORCED[self.fmt.name]
        options = []
        for tool in self.tools:
            fn = tool["function"]
            if self.choice == "named" and fn["name"] != self.name:
                continue
            options.append({"type": "object", "required": ["name", key], "properties": {
                "name": {"const": fn["name"]}, key: bounded_numbers(fn.get("parameters") or {"type": "object"})}})
        one = options[0] if len(options) == 1 else {"anyOf": options}
        return json.dumps({"type": "array", "items": one, "minItems": 1, "maxItems": 1} if listed else one)


def plan_tools(req, template: Any, parser: str | None = None) -> ToolPlan | None:
    """The chat request's tools and tool_choice, validated; None when no tool may be called. parser: the
    server's --tool-call-parser (None: the template's format)."""
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
    fmt = format_of_template(template) if parser is None else FORMATS[parser]
    if fmt is None:
        raise APIError("tools: this model's chat template renders no tools (pass --chat-template with one that "
                       "does, or send tool_choice \"none\")", param="tools")
    if choice != "auto" and fmt.name not in _FORCED:
        raise APIError(f"tool_choice: {choice if choice != 'named' else 'a named function'} is constrained for "
                       f"JSON call formats; this model's calls are {fmt.name} (send tool_choice auto)",
                       param="tool_choice")
    return ToolPlan([t if "type" in t else {"type": "function", **t} for t in tools], choice, name,
                    req.parallel_tool_calls is not False, fmt)


def fallback_call(plan: ToolPlan, generated: str) -> dict | None:
    """A forced call (required/named) that max_tokens cut short: the function's name (the named one, or the
    one the model had written) and, as arguments, what the model wrote of them. The answer is a call either
    way; finish_reason "length" tells the client it is incomplete. None when not even the name was written."""
    text = generated.split(plan.fmt.end, 1)[0] if plan.fmt.end else generated
    name = plan.name
    if name is None:
        found = re.search(r'"name"\s*:\s*"([^"]+)"', text)
        name = found.group(1) if found else None
    if name is None:
        return None
    key = f'"{_FORCED[plan.fmt.name][1]}":'
    return new_call(name, text.split(key, 1)[1].strip() if key in text else "")


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
    parser = ToolCallParser(plan.fmt)
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
