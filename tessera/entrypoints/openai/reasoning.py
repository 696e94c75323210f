"""`--reasoning-parser`: a thinking model's reasoning split from its answer, as SGLang does it.

The model writes `<think>...</think>` (or its family's markers) before the answer; the chat answer carries the
reasoning as `reasoning_content` (SGLang's and DeepSeek's name) and `reasoning` (vLLM's), and the answer as
`content`. Parsers are named as SGLang names them. A "forced" family starts its output inside the reasoning
(its chat template opens the think block in the prompt: DeepSeek-R1, Qwen3's thinking-only models), so text
before the end marker is reasoning even without a start marker. `chat_template_kwargs: {"enable_thinking":
false}` (the template then writes an empty think block itself) and SGLang's `separate_reasoning: false`
return the text as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's --reasoning-parser names -> (start marker, end marker, forced)
REASONING_PARSERS: dict[str, tuple[str, str, bool]] = {
    "deepseek-r1": ("<think>", "</think>", True),
    "deepseek-v3": ("<think>", "</think>", False),
    "qwen3": ("<think>", "</think>", False),
    "qwen3-thinking": ("<think>", "</think>", True),
    "glm45": ("<think>", "</think>", False),
    "step3": ("<think>", "</think>", True),
    "minimax": ("<think>", "</think>", False),
    "interns1": ("<think>", "</think>", False),
    "minimax-append-think": ("<think>", "</think>", False),
    "kimi": ("◁think▷", "◁/think▷", False),
    "mistral": ("[THINK]", "[/THINK]", False),
}


def check_reasoning_parser(name: str | None) -> None:
    """A one-line error naming the flag, before the model loads."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; one of {', '.join(REASONING_PARSERS)}")


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back until they cannot)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


@dataclass
class ReasoningSplitter:
    """Splits a reply into (reasoning, content), incrementally: `feed(delta)` returns the reasoning and content
    its text completes, `finish()` what was held back (a partial marker)."""

    start: str
    end: str
    state: str = "before"  # before (a start marker may come) | reasoning | content
    buffer: str = ""

    @classmethod
    def of(cls, name: str) -> ReasoningSplitter:
        start, end, forced = REASONING_PARSERS[name]
        return cls(start, end, "reasoning" if forced else "before")

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning = content = ""
        if self.state == "before":
            head = self.buffer.lstrip()
            if head.startswith(self.start):
                self.state, self.buffer = "reasoning", head[len(self.start):]
            elif self.start.startswith(head):  # empty, or a partial marker: wait
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.buffer.startswith(self.start):  # a forced family's model may still write the marker
                self.buffer = self.buffer[len(self.start):]
            at = self.buffer.find(self.end)
            if at < 0:
                keep = _held(self.buffer, self.end)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(self.end):].lstrip("\n")
            self.state = "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def splitter_for(parser: str | None, req) -> ReasoningSplitter | None:
    """The request's splitter: None without --reasoning-parser, or when the request turns thinking off."""
    if parser is None or req.separate_reasoning is False:
        return None
    if (req.chat_template_kwargs or {}).get("enable_thinking") is False:
        return None
    return ReasoningSplitter.of(parser)


def split_reasoning(splitter: ReasoningSplitter | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    if splitter is None:
        return None, text
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    return (reasoning.strip() or None), (content + more_content).lstrip("\n")


def reasoning_fields(reasoning: str | None) -> dict:
    """The message's (or delta's) reasoning under SGLang's and vLLM's names."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
