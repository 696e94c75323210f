"""ProgramState: the conversation a program builds, run expression by expression on its own thread.

`s += expr` queues the expression and returns at once; reading a result (`s["name"]`, `s.messages()`,
`s.text()`) waits for what was queued before it. So forks of a state, and the programs of a run_batch,
run their gen calls concurrently and the engine batches them (their shared prefix comes from its cache).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from tessera.lang.backend import Backend, Completion, Message, grammar_for_choices
from tessera.lang.ir import Concat, Expr, Gen, Media, Role, Select, Text, as_expr


class ProgramState:
    def __init__(self, backend: Backend, messages: list[Message] | None = None,
                 variables: dict[str, Any] | None = None, stream: bool = False):
        self.backend = backend
        # Streaming (run(stream=True)): gen text arrives as deltas, read with text_iter(); the program's
        # function has returned once `_closed` is set, so the iterator knows when nothing more can come.
        self._stream = stream
        self._chunks: deque[tuple[str | None, str]] = deque()  # (variable name, text) in output order
        self._closed = not stream
        self._messages: list[Message] = messages or []
        self._variables: dict[str, Any] = variables or {}
        self._meta: dict[str, dict] = {}
        self._queue: deque[Expr] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._error: BaseException | None = None

    # ---- appending --------------------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        expr = as_expr(other)
        with self._cond:
            self._queue.append(expr)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name="tessera-lang", daemon=True).start()
        return self

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    self._queue.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                self._run(expr, role=None)
            except BaseException as e:  # raised to whoever reads the state next
                self._error = e

    def close(self, error: BaseException | None = None) -> None:
        """The program will append nothing more (text_iter ends once everything queued has run)."""
        with self._cond:
            self._closed = True
            self._error = self._error or error
            self._cond.notify_all()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text the program adds, as it comes (gen deltas included); only a gen's when var_name is given.
        Needs run(stream=True)."""
        if not self._stream:
            raise ValueError("text_iter: run the program with stream=True")
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._chunks or (self._closed and not self._running) or
                                    self._error is not None)
                if self._error is not None:
                    raise self._error
                if not self._chunks:
                    return
                name, text = self._chunks.popleft()
            if var_name is None or name == var_name:
                yield text

    def _emit(self, name: str | None, text: str) -> None:
        if self._stream and text:
            with self._cond:
                self._chunks.append((name, text))
                self._cond.notify_all()

    def sync(self) -> ProgramState:
        """Waits until everything appended so far has run; re-raises the first error of the program."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            if self._error is not None:
                raise self._error
        return self

    # ---- running one expression -------------------------------------------------------------------------------
    def _run(self, expr: Expr, role: str | None) -> None:
        if isinstance(expr, Concat):
            for part in expr.parts:
                self._run(part, role)
        elif isinstance(expr, Role):
            if role is not None:
                raise ValueError(f"{expr.role}(): a message cannot be opened inside {role}()")
            self._messages.append(Message(expr.role, []))
            if expr.content is not None:
                self._run(expr.content, expr.role)
        elif isinstance(expr, Text):
            self._current(role, "text").parts.append(expr.text)
            self._emit(None, expr.text)
        elif isinstance(expr, Media):
            self._current(role, expr.modality).parts.append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr, role)
        elif isinstance(expr, Select):
            self._select(expr, role)
        else:
            raise TypeError(f"unknown expression {type(expr).__name__}")

    def _current(self, role: str | None, what: str) -> Message:
        if role is None and not self._messages:
            raise ValueError(f"{what}: put it in a message: s += user(...), assistant(...) or system(...)")
        return self._messages[-1]

    def _reply_target(self, role: str | None, what: str) -> Message:
        """The message a generated answer goes into: the open assistant turn, or a new one."""
        if role not in (None, "assistant"):
            raise ValueError(f"{what}: the model answers in assistant(...), not inside {role}(...)")
        if role is None:
            self._messages.append(Message("assistant", []))
        return self._messages[-1]

    def _record(self, name: str | None, value: str, target: Message, meta: dict, streamed: bool = False) -> None:
        target.parts.append(value)
        if not streamed:
            self._emit(name, value)
        if name is not None:
            self._variables[name] = value
            self._meta[name] = meta

    def _gen(self, expr: Gen, role: str | None) -> None:
        target = self._reply_target(role, "gen")
        if not self._stream:
            (out,) = self.backend.complete(self._messages, [expr.params])
            self._record(expr.name, out.text, target, _meta(out))
            return
        for item in self.backend.stream(self._messages, expr.params):
            if isinstance(item, str):
                self._emit(expr.name, item)
            else:
                self._record(expr.name, item.text, target, _meta(item), streamed=True)

    def _select(self, expr: Select, role: str | None) -> None:
        target = self._reply_target(role, "select")
        grammar = grammar_for_choices
        limit = max(len(c.encode()) for c in expr.choices) + 1  # a token is at least one byte (+ EOS)
        if expr.method == "constrained":
            (out,) = self.backend.complete(self._messages, [{"ebnf": grammar(expr.choices), "max_new_tokens": limit,
                                                             "temperature": expr.temperature}])
            self._record(expr.name, out.text, target, {**_meta(out), "choices": list(expr.choices)})
            return
        # Each choice forced as the continuation (a one-string grammar); the reported logprobs are the
        # model's own (taken before the grammar mask), so they score the choice.
        params = [{"ebnf": grammar((c,)), "max_new_tokens": limit, "temperature": 0} for c in expr.choices]
        outs = self.backend.complete(self._messages, params, logprobs=True)
        scores = []
        for out in outs:
            total = sum(out.token_logprobs)
            scores.append(total / max(len(out.token_logprobs), 1) if expr.normalize else total)
        best = max(range(len(scores)), key=scores.__getitem__)
        self._record(expr.name, expr.choices[best], target,
                     {"choices": list(expr.choices), "scores": scores, "cached_tokens": outs[best].cached_tokens})

    # ---- reading ----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        self.sync()
        return self._variables[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._variables.get(name, default)

    def get_meta_info(self, name: str) -> dict:
        """finish_reason, token counts and cached prompt tokens of a gen; choices and scores of a select."""
        self.sync()
        return self._meta[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._variables[name] = value

    def messages(self) -> list[dict]:
        """The conversation as OpenAI-style messages (media as {"type": "image"/"video"/"audio"} parts)."""
        self.sync()
        out = []
        for m in self._messages:
            if all(isinstance(p, str) for p in m.parts):
                out.append({"role": m.role, "content": m.text})
            else:
                out.append({"role": m.role, "content": [
                    {"type": "text", "text": p} if isinstance(p, str) else {"type": p.modality} for p in m.parts]})
        return out

    def text(self) -> str:
        """The conversation as plain text, one `role: content` line per message (media as <image> etc.)."""
        self.sync()
        return "\n".join(f"{m.role}: " + "".join(p if isinstance(p, str) else f"<{p.modality}>" for p in m.parts)
                         for m in self._messages)

    def fork(self, n: int = 1) -> ForkGroup:
        """n copies of the state so far, each to be continued on its own (concurrently)."""
        self.sync()
        return ForkGroup([ProgramState(self.backend, [Message(m.role, list(m.parts)) for m in self._messages],
                                       dict(self._variables)) for _ in range(n)])


class ForkGroup(list):
    """The states fork() made; `forks += expr` appends expr to each, `join()` waits for all."""

    def __iadd__(self, other: Any) -> ForkGroup:
        for state in self:
            state += other
        return self

    def join(self) -> ForkGroup:
        for state in self:
            state.sync()
        return self


def _meta(out: Completion) -> dict:
    return {"finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens, "completion_tokens": out.completion_tokens}
