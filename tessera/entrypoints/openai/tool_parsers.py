"""How tool calls are written by each model family, and the one incremental parser over them.

A format says where a call region starts (a marker, or the reply's first character), where it ends (a marker, or
the reply's end) and how the region's text becomes calls. `ToolCallParser` runs any format over a reply fed in
pieces (token by token when streamed): content before a region streams at once, text that could still be the
start of a marker is held back until it cannot, and each call is returned when its region is complete. A
region that does not parse as calls is the model's text, returned as content. Names are SGLang's
`--tool-call-parser` names (plus `llama4`, Llama-4's JSON or pythonic calls, and `gemma`, Gemma-3's
tool_code blocks); without the flag the format is read from the chat template (`format_of_template`).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field


def new_call(name: str, arguments) -> dict:
    """An OpenAI tool call; arguments as a JSON string (kept as written when the model wrote a string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_calls(payload: str) -> list[dict] | None:
    """One or more JSON objects {"name": ..., "arguments"|"parameters": {...}} (a list, or separated by ';')."""
    payload = payload.strip()
    try:
        objs = json.loads(payload)
    except json.JSONDecodeError:
        try:
            objs = [json.loads(part) for part in payload.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    objs = objs if isinstance(objs, list) else [objs]
    if not objs or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
        return None
    return [new_call(o["name"], o.get("arguments", o.get("parameters", {}))) for o in objs]


def _pythonic_calls(payload: str) -> list[dict] | None:
    """`[f(a=1, b="x"), g()]` (or the calls without brackets, one per line): Python literals as arguments."""
    text = payload.strip()
    if not text:
        return None
    if not text.startswith("["):
        text = "[" + ", ".join(line.strip() for line in text.splitlines() if line.strip()) + "]"
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(new_call(node.func.id, args))
    return calls


def _glm_calls(payload: str) -> list[dict] | None:
    """GLM-4.5's `name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...` (values JSON where they parse)."""
    name, _, rest = payload.strip().partition("\n")
    if not re.fullmatch(r"[\w.\-]+", name.strip()):
        return None
    args = {}
    for key, value in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, flags=re.S):
        try:
            args[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip()] = value
    return [new_call(name.strip(), args)]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]  # markers that open a call region
    end: str | None  # the marker that closes one; None: the region runs to the next start or the reply's end
    parse: object  # region text -> calls, or None when it is not calls
    at_start_only: bool = False  # the markers count only as the reply's first non-blank text (JSON / pythonic)
    strip: tuple[str, ...] = ()  # markers removed from a region before parsing


HERMES = ToolFormat("hermes", ("<tool_call>",), "</tool_call>", _json_calls)
FORMATS: dict[str, ToolFormat] = {
    "hermes": HERMES, "qwen25": HERMES, "qwen": HERMES,
    "llama3": ToolFormat("llama3", ("<|python_tag|>", "{"), None, _json_calls, at_start_only=True),
    "pythonic": ToolFormat("pythonic", ("<|python_start|>", "["), None, _pythonic_calls, at_start_only=True,
                           strip=("<|python_end|>",)),
    "llama4": ToolFormat("llama4", ("<|python_start|>", "[", "{"), None,
                         lambda p: _json_calls(p) or _pythonic_calls(p), at_start_only=True,
                         strip=("<|python_end|>",)),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), None,
                          lambda p: _json_calls(p) or _json_calls(re.sub(r"^\s*([\w.\-]+)\s*\[ARGS\]",
                                                                         r'{"name": "\1", "arguments": ', p) + "}")),
    "gemma": ToolFormat("gemma", ("```tool_code",), "```", _pythonic_calls),
    "internlm": ToolFormat("internlm", ("<|action_start|>",), "<|action_end|>", _json_calls, strip=("<|plugin|>",)),
    "glm45": ToolFormat("glm45", ("<tool_call>",), "</tool_call>", _glm_calls),
}
FORMATS["interns1"], FORMATS["glm"] = FORMATS["internlm"], FORMATS["glm45"]


def check_tool_call_parser(name: str | None) -> None:
    if name is not None and name not in FORMATS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; one of {', '.join(FORMATS)}")


def format_of_template(template) -> ToolFormat | None:
    """The call format a chat template renders tools in (None: it renders no tools)."""
    if isinstance(template, dict):  # named templates: the one that renders tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<arg_key>" in template:
        return FORMATS["glm45"]
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|action_start|>" in template:
        return FORMATS["internlm"]
    if "<|python_start|>" in template:
        return FORMATS["llama4"]
    if "<|python_tag|>" in template:
        return FORMATS["llama3"]
    if "tool_code" in template:
        return FORMATS["gemma"]
    return None


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The longest end of `text` that is the beginning of a marker (held back: it may become one)."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])),
               default=0)


@dataclass
class ToolCallParser:
    """Splits model text into content and tool calls, incrementally.

    `feed(delta)` returns (content delta, calls completed by it); `finish()` flushes the rest: a region left open
    at the end (EOS right after its JSON, or a format whose region runs to the end) is parsed if it is valid,
    else returned as content."""

    fmt: ToolFormat = HERMES
    buffer: str = ""
    in_call: bool = False
    opened: str = ""  # the marker that opened the region in progress
    seen_text: bool = False  # at_start_only: the reply's first non-blank text has been seen
    calls: list[dict] = field(default_factory=list)

    def _region(self, payload: str) -> list[dict] | None:
        for marker in self.fmt.strip:
            payload = payload.replace(marker, "")
        if self.opened in ("[", "{"):  # the marker is the payload's own first character
            payload = self.opened + payload
        return self.fmt.parse(payload)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, done = "", []
        while True:
            if self.in_call:
                end = self._region_end()
                if end is None:
                    break
                at, skip = end
                payload, self.buffer = self.buffer[:at], self.buffer[at + skip:]
                calls = self._region(payload)
                self.in_call = False
                if calls is None:
                    content += self.opened + payload + (self.fmt.end if skip else "")
                else:
                    done += calls
                continue
            if self.fmt.at_start_only and self.seen_text:
                content, self.buffer = content + self.buffer, ""
                break
            start, marker = self._find_start()
            if start is None:
                if self.fmt.at_start_only:
                    head = self.buffer.lstrip()
                    if head and not any(m.startswith(head) for m in self.fmt.starts):
                        self.seen_text = True
                        continue
                    break  # blank so far, or a marker's beginning: wait
                keep = _partial(self.buffer, self.fmt.starts)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content += self.buffer[:start]
            self.buffer, self.in_call, self.opened = self.buffer[start + len(marker):], True, marker
            self.seen_text = True
        self.calls += done
        return content, done

    def _find_start(self) -> tuple[int | None, str]:
        if self.fmt.at_start_only:
            head = self.buffer.lstrip()
            for m in self.fmt.starts:
                if head.startswith(m) and not self.seen_text:
                    return len(self.buffer) - len(head), m
            return None, ""
        found = [(self.buffer.find(m), m) for m in self.fmt.starts if m in self.buffer]
        return min(found) if found else (None, "")

    def _region_end(self) -> tuple[int, int] | None:
        """Where the region in progress ends in the buffer (position, marker length), None if not yet."""
        if self.fmt.end is not None:
            at = self.buffer.find(self.fmt.end)
            return (at, len(self.fmt.end)) if at >= 0 else None
        nxt = [self.buffer.find(m) for m in self.fmt.starts if not self.fmt.at_start_only and m in self.buffer]
        return (min(nxt), 0) if nxt else None

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        calls = self._region(rest)
        if calls is None:
            return self.opened + rest, []
        self.calls += calls
        return "", calls
