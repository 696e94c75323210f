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
from tessera.frontend.result import GenerateResult

logger = logging.getLogger("tessera.server")


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_of(results: list[GenerateResult], prompts: int = 1) -> dict:
    """Usage of the choices' results; the prompt is counted once per distinct prompt (n samples share it)."""
    step = max(1, len(results) // max(1, prompts))
    return usage(sum(r.prompt_tokens for r in results[::step]), sum(r.completion_tokens for r in results),
                 sum(r.cached_tokens for r in results[::step]))


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

    def __call__(self, i: int, choice: dict, finish: str | None = None, logprobs=None,
                 result: GenerateResult | None = None) -> str:
        choice = {"index": i, **choice, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = result.matched_stop if result is not None else None
        body = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.opts.continuous_usage:  # every chunk, before the first token too (vLLM's continuous_usage_stats)
            body["usage"] = usage_of([result]) if result is not None else usage(self.prompt_lens[i], 0)
        return sse(body)

    def end(self, results: dict[int, GenerateResult], prompts: int = 1) -> Iterator[str]:
        """The usage chunk (when asked for) and [DONE]."""
        if self.opts.include_usage:
            yield sse({"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_of([results[i] for i in sorted(results)], prompts)})
        yield sse("[DONE]")
