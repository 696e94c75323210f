"""The expressions a program appends to its state: text, roles, media, gen and select.

They are plain values: `s += user("Hi " + image(path))` builds a Role holding a Concat, and the state
runs it (state.py). `+` concatenates expressions (and strings) in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    """Base of every program expression; `a + b` runs a, then b."""

    def __add__(self, other: Any) -> Concat:
        return Concat((*_parts(self), *_parts(as_expr(other))))

    def __radd__(self, other: Any) -> Concat:
        return Concat((*_parts(as_expr(other)), *_parts(self)))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    text: str


@dataclass(frozen=True, eq=False)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Role(Expr):
    """One chat message: `role`'s turn holding `content` (None: an empty turn)."""

    role: str  # "system" | "user" | "assistant"
    content: Expr | None


@dataclass(frozen=True, eq=False)
class Media(Expr):
    """An image, video or audio in the current message. source: a path, URL, data URI or (image) a PIL image."""

    modality: str  # "image" | "video" | "audio"
    source: Any
    num_frames: int | None = None  # videos: frames sampled from the clip (None: the processor's default)


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text at this point; stored under `name`. `params` are SamplingParams fields (max_new_tokens,
    temperature, stop, regex, json_schema, ebnf, ...)."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Pick one of `choices` at this point; stored under `name`.

    method "logprob": each choice is scored by the model's log-probability of it as the continuation (the
    mean over its tokens by default, `normalize=False` for the sum) and the best one is taken. method
    "constrained": one generation constrained to the choices (the model writes one of them).
    """

    name: str | None
    choices: tuple[str, ...]
    method: str = "logprob"
    normalize: bool = True
    temperature: float = 0.0


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program appends strings or tessera.lang expressions, got {type(value).__name__}")


def _parts(expr: Expr) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, Concat) else (expr,)


# ---- the public constructors -----------------------------------------------------------------------------------
_GEN_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
# gen(dtype=...) as in SGLang: the answer is constrained to a literal of that type.
_DTYPE_REGEX = {int: r"[-+]?[0-9]+", float: r"[-+]?[0-9]+(\.[0-9]+)?", bool: r"(True|False)"}


def gen(name: str | None = None, max_tokens: int | None = None, *, stop: str | list[str] | None = None,
        temperature: float | None = None, choices: list[str] | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, ebnf: str | None = None, dtype: type | None = None,
        **params: Any) -> Expr:
    """Generate here and store the text under `name`. Other keyword arguments are SamplingParams fields
    (top_p, top_k, min_p, seed, frequency_penalty, ...; max_tokens/min_tokens as OpenAI spells them).
    `choices` makes it a select(); `dtype` (int, float or bool) constrains the answer to such a literal."""
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0)
    if dtype is not None and dtype is not str:
        if dtype not in _DTYPE_REGEX or regex is not None:
            raise ValueError(f"gen: dtype must be int, float, bool or str (and not with regex), got {dtype!r}")
        regex = _DTYPE_REGEX[dtype]
    given = dict(max_tokens=max_tokens, stop=stop, temperature=temperature, regex=regex, json_schema=json_schema,
                 ebnf=ebnf, **params)
    return Gen(name, {_GEN_ALIASES.get(k, k): v for k, v in given.items() if v is not None})


def select(name: str | None = None, choices: list[str] | tuple[str, ...] = (), *, method: str = "logprob",
           normalize: bool = True, temperature: float = 0.0) -> Select:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select: choices must be a non-empty list of non-empty strings")
    if method not in ("logprob", "constrained"):
        raise ValueError(f"select: method must be 'logprob' or 'constrained', got {method!r}")
    return Select(name, tuple(choices), method, normalize, temperature)


def image(source: Any) -> Media:
    return Media("image", source)


def video(source: Any, num_frames: int | None = None) -> Media:
    return Media("video", source, num_frames)


def audio(source: Any) -> Media:
    return Media("audio", source)


def system(content: Any = None) -> Role:
    return Role("system", None if content is None else as_expr(content))


def user(content: Any = None) -> Role:
    return Role("user", None if content is None else as_expr(content))


def assistant(content: Any = None) -> Role:
    return Role("assistant", None if content is None else as_expr(content))
