"""OpenAI response pieces shared by chat, completions and SGLang's /generate.

SSE framing, the in-band error event of a stream that fails after its first byte, the chunk writer of
streamed choices, finish reasons and usage. One place, so the three endpoints answer in the same shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from tessera.entrypoints.openai.errors import APIError, public_message
from tessera.entrypoints.openai.protocol import StreamOptions

logger = logging.getLogger("tessera.server")


def finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(fr["type"], fr["type"])


def matched_stop(meta: dict):
    """SGLang's matched_stop: the stop string or token id that ended the choice (None otherwise)."""
    fr = meta.get("finish_reason") or {}
    return fr.get("matched") if fr.get("type") == "stop" else None


def usage_of(metas: list[dict], prompts: int = 1) -> dict:
    """Usage of the choices' metas; the prompt is counted once per distinct prompt (n samples share it)."""
    step = max(1, len(metas) // max(1, prompts))
    prompt = sum(m["prompt_tokens"] for m in metas[::step])
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens", 0) for m in metas[::step])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(gen: AsyncIterator[str]) -> StreamingResponse:
    """The SSE response of gen; an exception after the first byte becomes an error event, then [DONE]."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:  # noqa: BLE001 -- the status line is sent: the error must travel in-band
            public = isinstance(e, APIError) or getattr(e, "public", False)
            if public:
                logger.warning("stream failed after it started: %s", e)
            else:
                logger.exception("stream failed after it started")
            status = getattr(e, "status", 500)
            message = public_message(str(e)) if public else "internal server error (details in the server log)"
            err = APIError(message, status, getattr(e, "param", None))
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}})
            yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream")


@dataclass
class ChunkWriter:
    """SSE chunks of one streamed response (chat.completion.chunk or text_completion)."""

    rid: str
    created: int
    model: str
    object: str
    opts: StreamOptions
    prompt_lens: list[int]  # each choice's prompt tokens, for usage before its first token

    def __call__(self, i: int, choice: dict, finish: str | None = None, logprobs=None, meta: dict | None = None) -> str:
        choice = {"index": i, **choice, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched_stop(meta or {})
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.opts.continuous_usage:  # every chunk, before the first token too (vLLM's continuous_usage_stats)
            body["usage"] = usage_of([meta or {"prompt_tokens": self.prompt_lens[i], "completion_tokens": 0}])
        return sse(body)

    def end(self, metas: dict[int, dict], prompts: int = 1) -> Iterator[str]:
        """The usage chunk (when asked for) and [DONE]."""
        if self.opts.include_usage:
            yield sse({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_of([metas[i] for i in sorted(metas)], prompts)})
        yield sse("[DONE]")
