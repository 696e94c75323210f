"""POST /v1/audio/transcriptions: OpenAI's speech-to-text endpoint over an audio chat model (Qwen2-Audio,
Qwen3-ASR, GLM-ASR).

A Whisper checkpoint is served by whisper_transcriptions.py (also /v1/audio/translations): the form, the audio
decoding, the windows and the response formats here are shared.

How the model is prompted, where its transcript starts and which language is reported: speech_prompts.py
(Qwen2-Audio: the chat template with the audio followed by `Transcribe the audio.`; Qwen3-ASR and GLM-ASR: their
processor's own transcription request). Audio longer than the window (the feature extractor's chunk, Whisper's
30 s) is cut at quiet points with a small overlap
(tessera.multimodal.audio_windows); the windows are decoded concurrently as separate requests and their
transcripts joined with a space, in order. Each window is one segment of verbose_json / srt / vtt.
Streaming sends OpenAI's `transcript.text.delta` events window after window, then `transcript.text.done`.

Not done: word timestamps, translation (a Whisper checkpoint does both); language detection where the model
does not write the language (Qwen3-ASR does).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.serving import OpenAIServing
from tessera.entrypoints.openai import request_models as rm
from tessera.entrypoints.openai.speech_prompts import TranscriptionStyle
from tessera.entrypoints.openai.transcript_format import (
    TranscriptionRequest,
    WindowResult,
    _segment,
    join_transcripts,
    render,
)
from tessera.frontend.request import GenerateRequest
from tessera.multimodal.audio_windows import AudioWindow, split_audio
from tessera.multimodal.media import MediaError, load_audio
from tessera.messages.sampling import SamplingParams

STREAM_FORMATS = ("json", "text")
# Output budget per window: generous for speech (~3 words/s), and it bounds a model that never stops.
MAX_TOKENS_PER_SECOND = 10
MIN_TOKENS_PER_WINDOW = 16
_LANGUAGE_RE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?$")


def _known_language(code: str) -> bool:
    """OpenAI's transcription languages are Whisper's; transformers ships that table."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return code.split("-")[0].lower() in LANGUAGES


async def parse_transcription_form(request: Request, max_bytes: int) -> TranscriptionRequest:
    """Reads the multipart form and validates it as its model (request_models.TranscriptionRequest); APIError
    (400) naming the field on anything wrong."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(f"body: expected multipart/form-data with a 'file' part, got content-type {content_type!r}",
                       param="file")
    try:
        form = await request.form()
    except Exception as e:  # noqa: BLE001 - malformed multipart bodies of any kind are user errors
        raise APIError(f"body: malformed multipart form ({e})", param="file") from None
    known = rm.TRANSCRIPTION_FIELDS
    unknown = sorted(set(form.keys()) - known)
    if unknown:
        raise APIError(f"{unknown[0]}: unknown field (accepted: {', '.join(sorted(known))})", param=unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError("file: the audio file part is required (multipart field 'file')", param="file")
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise APIError(f"file: audio is larger than the limit of {max_bytes} bytes", param="file")
    if not data:
        raise APIError("file: the audio file is empty", param="file")
    # An empty text field is the field left out (as OpenAI's clients send them).
    fields = {name: form.getlist(name) if name.endswith("[]") else form.get(name) for name in form.keys()}
    try:
        req = rm.TranscriptionRequest.model_validate({**{k: v for k, v in fields.items() if v != ""}, "file": data})
    except ValidationError as e:
        raise rm.field_error(e.errors(include_url=False)) from None
    language = req.language or None
    if language is not None and (not _LANGUAGE_RE.match(language) or not _known_language(language)):
        raise APIError(f"language: expected an ISO-639-1 code of a language speech models know, such as 'en', "
                       f"got {language!r}", param="language")
    granularities = tuple(req.timestamp_granularities or ())
    if "word" in granularities:
        raise APIError("timestamp_granularities: only 'segment' is supported, got 'word'",
                       param="timestamp_granularities")
    if req.stream and req.response_format not in STREAM_FORMATS:
        raise APIError(f"stream: streaming is supported with response_format json or text, not "
                       f"{req.response_format!r}", param="stream")
    return TranscriptionRequest(data, req.model, language, req.prompt or None, req.response_format,
                                req.temperature, req.stream, granularities)


# ---- serving ---------------------------------------------------------------------------------------


class TranscriptionServing:
    """The endpoint over a TokenizerManager; `serving` (OpenAIServing) supplies model-name checks and
    disconnect-aware collection."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.tm = serving.tm
        self._style: TranscriptionStyle | None = None

    def _check_audio_model(self, model: str) -> None:
        self.serving.check_model(model)
        info = self.tm.info
        if not info.has_audio_understanding:
            reason = (info.no_media_reason() if info.args.language_model_only else
                      f"model {self.serving.model_name!r} ({info.architecture}) does not understand audio")
            raise APIError(f"model: {reason}; /v1/audio/transcriptions needs an audio model such as "
                           "Qwen2-Audio (e.g. --model-path demo-asr)", param="model")

    @property
    def style(self) -> TranscriptionStyle:
        if self._style is None:
            processor = self.tm.mm_processor
            self._style = TranscriptionStyle.of(self.tm.info, getattr(processor, "hf_processor", None))
        return self._style

    async def _decode(self, data: bytes) -> tuple[np.ndarray, int]:
        processor = self.tm.mm_processor
        assert processor is not None, "an audio model always has a multimodal processor"
        rate = int(processor.audio_sampling_rate)
        loop = asyncio.get_running_loop()
        try:  # decoding is CPU work: off the event loop
            samples = await loop.run_in_executor(
                self.tm.executor, lambda: load_audio(data, limits=processor.limits, sampling_rate=rate))
        except MediaError as e:
            raise APIError(f"file: {e}", status=e.status, param="file") from None
        if len(samples) == 0:
            raise APIError("file: the audio has no samples", param="file")
        return samples, rate

    def _requests(self, req: TranscriptionRequest, samples: np.ndarray, rate: int,
                  windows: list[AudioWindow]) -> list[GenerateRequest]:
        text = self.style.prompt(req.language, req.prompt)
        out = []
        for w in windows:
            budget = max(MIN_TOKENS_PER_WINDOW, math.ceil((w.end - w.start) / rate * MAX_TOKENS_PER_SECOND))
            sp = SamplingParams(temperature=req.temperature, max_new_tokens=budget).normalize()
            out.append(GenerateRequest(text=text, audio_data=[samples[w.start: w.end]], sampling_params=sp,
                                       return_logprob=True, stream=req.stream))
        return out

    async def create(self, request: Request, task: str = "transcribe") -> Response:
        """task: "transcribe" (/v1/audio/transcriptions) or "translate" (/v1/audio/translations, Whisper only)."""
        from tessera.entrypoints.openai.whisper_transcriptions import WhisperTranscriber

        limits = self.tm.mm_processor.limits if self.tm.mm_processor is not None else None
        max_bytes = limits.max_audio_bytes if limits is not None else 64 << 20
        req = await parse_transcription_form(request, max_bytes)
        self._check_audio_model(req.model)
        whisper = WhisperTranscriber.of(self)
        if whisper is not None:
            plan = whisper.plan(req, task)  # refuses a bad language, task or prompt before any decoding
        elif task != "transcribe":
            raise APIError(f"model: {self.tm.info.architecture} has no translate task; /v1/audio/translations needs "
                           "a Whisper checkpoint", param="model")
        samples, rate = await self._decode(req.audio)
        chunk_s = float(getattr(self.tm.mm_processor, "chunk_seconds", 30.0))
        windows = split_audio(samples, rate, chunk_s)
        if whisper is not None:
            return await whisper.respond(request, req, plan, samples, rate, windows)
        reqs = self._requests(req, samples, rate, windows)
        duration = len(samples) / rate
        if req.stream:
            stream = await self.serving._first_or_error(self._stream(reqs, self.style.marker(req.language)))
            return StreamingResponse(stream, media_type="text/event-stream")
        outs = await self.serving._collect_all(request, reqs)
        split = [self.style.split(out.text, req.language) for out in outs]
        results = [WindowResult(w, text, list(out.output_ids), [lp for lp, _ in out.output_logprobs])
                   for w, out, (text, _) in zip(windows, outs, split)]
        language = self.style.reported_language([lang for _, lang in split], req.language)
        return self._render(req, results, rate, duration, language)

    def _render(self, req: TranscriptionRequest, results: list[WindowResult], rate: int, duration: float,
                language: str) -> Response:
        text = join_transcripts([r.text for r in results])
        segments = [_segment(i, r, rate, req.temperature) for i, r in enumerate(results)]
        return render(req.response_format, text, segments, duration, language, "transcribe")

    async def _stream(self, reqs: list[GenerateRequest], marker: str | None = None) -> AsyncIterator[str]:
        """All windows decode concurrently; their deltas are sent in window order (a later window's text
        waits in its queue until the earlier ones are done). The deltas add up to exactly the done event's
        text, join_transcripts of the window texts: whitespace at a window's edges is held back, and one
        space separates windows; with a `marker`, a window's text up to it is held back and dropped (all of it
        is the transcript when the marker never comes). A failure before the first event propagates (an HTTP
        error, see _first_or_error); a later one becomes an `error` event."""
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in reqs]
        done = object()

        async def pump(i: int) -> None:
            try:
                async for out in self.tm.generate(reqs[i]):
                    await queues[i].put(out)
            except Exception as e:  # noqa: BLE001 - handed to the consumer below
                await queues[i].put(e)
            finally:
                await queues[i].put(done)

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(reqs))]
        texts: list[str] = []
        input_tokens = output_tokens = 0
        started = False
        try:
            for queue in queues:
                window_text, pending, raw = "", "", ""
                while (item := await queue.get()) is not done:
                    if isinstance(item, Exception):
                        if not started:
                            raise item
                        yield _sse({"type": "error", "error": {"message": str(item)}})
                        return
                    if item.finished:
                        input_tokens += item.prompt_tokens
                        output_tokens += item.completion_tokens
                    delta = item.delta
                    if marker is not None and raw is not None:  # the transcript starts after the marker
                        raw += delta
                        finished = item.finished
                        if marker not in raw and not finished:
                            continue
                        delta = raw.split(marker, 1)[1] if marker in raw else raw
                        raw = None
                    combined = pending + delta
                    if not window_text:
                        combined = combined.lstrip()
                    emit = combined.rstrip()
                    pending = combined[len(emit):]
                    if not emit:
                        continue
                    prefix = " " if not window_text and any(texts) else ""
                    window_text += emit
                    started = True
                    yield _sse({"type": "transcript.text.delta", "delta": prefix + emit})
                texts.append(window_text)
            usage = {"type": "tokens", "input_tokens": input_tokens, "output_tokens": output_tokens,
                     "total_tokens": input_tokens + output_tokens}
            yield _sse({"type": "transcript.text.done", "text": join_transcripts(texts), "usage": usage})
            yield _sse("[DONE]")
        finally:
            for t in tasks:  # a client that went away: each generate()'s finally aborts its request
                t.cancel()


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
