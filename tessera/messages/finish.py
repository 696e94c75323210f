"""FinishReason: why a request ended, as one typed value from the scheduler to every endpoint.

The scheduler decides (scheduler/stops.py, its abort and failure paths); the frontend's detokenizer cuts the
text at a matched stop string; the endpoints show it in two shapes, each written here only:
- SGLang's meta_info `finish_reason` (native /generate, the Engine): {"type": "stop", "matched": id, string or
  None} / {"type": "length", "length": N} / {"type": "abort", "message": ...};
- OpenAI's `finish_reason` string ("stop", "length", "abort") and SGLang's `matched_stop` beside it.
An error ends a request with an exception in the frontend (HTTP 500, or 503 when `unavailable`), never as a
finish shown to a client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishKind(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string, the grammar's end, or an embedding's one step
    LENGTH = "length"  # max_new_tokens, or the context is full
    ABORT = "abort"  # the client went away
    ERROR = "error"  # the scheduler failed the request (or no scheduler can serve it)


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # STOP: the stop token id or stop string (None: grammar end, embedding)
    length: int = 0  # LENGTH: the output tokens when it ended
    message: str = ""  # ABORT, ERROR: one line
    unavailable: bool = False  # ERROR: no scheduler can serve it (HTTP 503, the message public)

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls(FinishKind.STOP, matched=matched)

    @classmethod
    def of_length(cls, length: int) -> FinishReason:
        return cls(FinishKind.LENGTH, length=length)

    @classmethod
    def abort(cls, message: str = "aborted by client") -> FinishReason:
        return cls(FinishKind.ABORT, message=message)

    @classmethod
    def error(cls, message: str, unavailable: bool = False) -> FinishReason:
        return cls(FinishKind.ERROR, message=message, unavailable=unavailable)

    @property
    def is_error(self) -> bool:
        return self.kind is FinishKind.ERROR

    @property
    def stop_string(self) -> str | None:
        """The stop string it matched (None for a stop token, a length limit, ...): the text is cut there."""
        return self.matched if self.kind is FinishKind.STOP and isinstance(self.matched, str) else None

    @property
    def matched_stop(self) -> int | str | None:
        """SGLang's matched_stop on an OpenAI choice: the stop token id or string that ended it, else None."""
        return self.matched if self.kind is FinishKind.STOP else None

    @property
    def openai(self) -> str:
        """OpenAI's finish_reason string."""
        return self.kind.value

    def to_meta(self) -> dict:
        """SGLang's meta_info finish_reason (the wire shape of /generate and the Engine's outputs)."""
        if self.kind is FinishKind.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.kind is FinishKind.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": self.kind.value, "message": self.message}
