"""The transcription endpoints' request and response shapes, shared by the Qwen2-Audio path
(transcriptions.py) and Whisper's (whisper_transcriptions.py): the validated form, a window's result, and
OpenAI's response formats (json, text, srt, vtt, verbose_json)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tessera.multimodal.audio_windows import AudioWindow


@dataclass(frozen=True)
class TranscriptionRequest:
    """The multipart form, validated."""

    audio: bytes
    model: str
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool
    timestamp_granularities: tuple[str, ...] = ()


@dataclass
class WindowResult:
    window: AudioWindow
    text: str
    output_ids: list[int]
    logprobs: list[float]


def _timestamp(seconds: float, decimal: str) -> str:
    ms = int(round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


def cue_text(text: str) -> str:
    """A segment's text as one subtitle line: a blank line would end the cue early and `-->` would read as
    a timing line, so line breaks become spaces and arrows are defused (as Whisper's writers do)."""
    return " ".join(text.split()).replace("-->", "->")


def format_srt(segments: list[dict]) -> str:
    """SubRip: numbered cues from 1, `HH:MM:SS,mmm --> HH:MM:SS,mmm`, a blank line after each cue.
    Segments without text get no cue."""
    cues = [(s, cue_text(s["text"])) for s in segments]
    return "".join(f"{i}\n{_timestamp(s['start'], ',')} --> {_timestamp(s['end'], ',')}\n{text}\n\n"
                   for i, (s, text) in enumerate([c for c in cues if c[1]], start=1))


def format_vtt(segments: list[dict]) -> str:
    """WebVTT: the `WEBVTT` header, then `HH:MM:SS.mmm --> HH:MM:SS.mmm` cues."""
    cues = [(s, cue_text(s["text"])) for s in segments]
    return "WEBVTT\n\n" + "".join(f"{_timestamp(s['start'], '.')} --> {_timestamp(s['end'], '.')}\n{text}\n\n"
                                  for s, text in cues if text)


def compression_ratio(text: str) -> float:
    """Whisper's repetition signal: raw length / zlib-compressed length (1.0 for empty text)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 1.0


def _segment(i: int, r: WindowResult, rate: int, temperature: float) -> dict:
    start, end = r.window.seconds(rate)
    return {"id": i, "seek": r.window.seg_start * 100 // rate,  # Whisper's seek: 10 ms mel frames
            "start": round(start, 3), "end": round(end, 3), "text": r.text, "tokens": r.output_ids,
            "temperature": temperature,
            "avg_logprob": float(np.mean(r.logprobs)) if r.logprobs else 0.0,
            "compression_ratio": compression_ratio(r.text),
            # Qwen2-Audio has no no-speech head (Whisper's <|nospeech|> probability): not estimated.
            "no_speech_prob": 0.0}


def join_transcripts(texts: list[str]) -> str:
    return " ".join(t.strip() for t in texts if t.strip())


def render(response_format: str, text: str, segments: list[dict], duration: float, language: str,
           task: str) -> Response:
    """The response in OpenAI's format: json, text, srt, vtt, or verbose_json (segments, language, task)."""
    usage = {"type": "duration", "seconds": math.ceil(duration)}
    if response_format == "json":
        return JSONResponse({"text": text, "usage": usage})
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "srt":
        return PlainTextResponse(format_srt(segments), media_type="application/x-subrip")
    if response_format == "vtt":
        return PlainTextResponse(format_vtt(segments), media_type="text/vtt")
    return JSONResponse({"task": task, "language": language, "duration": round(duration, 3), "text": text,
                         "segments": segments, "usage": usage})
