"""/v1/audio/transcriptions and /v1/audio/translations over a Whisper checkpoint.

Each window of the audio (transcriptions.py cuts audio longer than the encoder's window at quiet points) is one
request whose decoder prompt is Whisper's: `[<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|task|>`,
then `<|notimestamps|>` unless segments are wanted. The windows decode concurrently and their texts are joined.

- language: the form's ISO-639-1 code, checked against the checkpoint's generation_config.lang_to_id; when absent,
  detected once on the first window (a one-token request whose prompt ends at `<|startoftranscript|>`, so only
  language tokens are allowed, as HF's detect_language) and used for every window; verbose_json reports it.
- segments (verbose_json, srt, vtt, or timestamp_granularities[]=segment): the windows decode with timestamps,
  each `<|a|> text <|b|>` is a segment, its times offset by the window's start in the audio and clamped to the
  part of the audio the window reports (adjacent windows share 0.2 s around a cut).
- prompt: previous text, as Whisper conditions on it (its last max_target_positions // 2 - 1 tokens).
- translate: only for checkpoints whose generation_config.task_to_id has it.
Not done: word timestamps, temperature fallback, no_speech_prob (reported as 0.0: the probability of
<|nospeech|> after <|startoftranscript|> is not computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.transcript_format import (
    TranscriptionRequest,
    compression_ratio,
    join_transcripts,
    render,
)
from tessera.frontend.request import GenerateRequest
from tessera.models.whisper_decoding import WhisperTokens, timed_segments
from tessera.multimodal.audio_windows import AudioWindow
from tessera.messages.sampling import SamplingParams

if TYPE_CHECKING:
    from tessera.entrypoints.openai.serving import OpenAIServing

SEGMENT_FORMATS = ("verbose_json", "srt", "vtt")


@dataclass(frozen=True)
class WhisperPlan:
    """What every window of one request decodes with."""

    language: str | None  # None: detect on the first window (or an English-only checkpoint without language tokens)
    task: str
    timestamps: bool
    previous: list[int]  # the prompt's tokens


class WhisperTranscriber:
    def __init__(self, serving: OpenAIServing, tokens: WhisperTokens):
        self.serving = serving
        self.tm = serving.tm
        self.tokens = tokens
        self.max_target_positions = self.tm.info.config.max_position_embeddings

    @classmethod
    def of(cls, serving: OpenAIServing) -> WhisperTranscriber | None:
        """The transcriber when the served model is an encoder-decoder (Whisper), else None."""
        config = serving.tm.info.config
        if not config.family.encoder_decoder:
            return None
        return cls(serving, WhisperTokens.from_generation_config(config.generation_config, config.hf_config))

    # ---- the request ----------------------------------------------------------------------------------------

    def plan(self, req: TranscriptionRequest, task: str) -> WhisperPlan:
        """Checks language, task and prompt against the checkpoint; APIError (400) naming the field."""
        language = req.language.split("-")[0].lower() if req.language else None  # "en-US": Whisper's "en"
        if language is not None and language not in self.tokens.lang_to_id:
            known = ", ".join(sorted(self.tokens.lang_to_id)) or "none (an English-only checkpoint)"
            if self.tokens.lang_to_id or language != "en":
                raise APIError(f"language: {req.language!r} is not a language of this checkpoint; it knows {known}",
                               param="language")
            language = None  # English-only: no language token
        if task not in self.tokens.task_to_id:
            if task == "translate":
                raise APIError("model: this Whisper checkpoint has no translate task (its generation_config's "
                               "task_to_id lacks 'translate'); use /v1/audio/transcriptions", param="model")
            task = ""  # an English-only checkpoint: no task token
        timestamps = (req.response_format in SEGMENT_FORMATS or "segment" in req.timestamp_granularities) and \
            self.tokens.supports_timestamps
        previous: list[int] = []
        if req.prompt:
            if self.tokens.prev_sot is None:
                raise APIError("prompt: this checkpoint has no <|startofprev|> token to condition on a prompt",
                               param="prompt")
            previous = list(self.tm.tokenizer.encode(" " + req.prompt.strip(), add_special_tokens=False))
            if any(t >= self.tokens.eot for t in previous):
                raise APIError("prompt: contains Whisper's special or timestamp tokens", param="prompt")
            previous = previous[-(self.max_target_positions // 2 - 1):]
        return WhisperPlan(language, task, bool(timestamps), previous)

    def _prompt(self, plan: WhisperPlan, language: str | None) -> list[int]:
        return self.tokens.decoder_prompt(language, plan.task or None, plan.timestamps, plan.previous)

    async def _detect_language(self, request: Request, clip: np.ndarray) -> str | None:
        if not self.tokens.lang_to_id:
            return None
        sp = SamplingParams(temperature=0.0, max_new_tokens=1).normalize()
        [out] = await self.serving.serving._collect_all(
            request, [GenerateRequest(input_ids=self.tokens.language_prompt(), audio_data=[clip], sampling_params=sp)])
        return self.tokens.language_of(out.output_ids[0]) if out.output_ids else None

    def _requests(self, req: TranscriptionRequest, plan: WhisperPlan, language: str | None, samples: np.ndarray,
                  windows: list[AudioWindow]) -> list[GenerateRequest]:
        prompt = self._prompt(plan, language)
        # HF generate's bound (generation_config's max_length / max_new_tokens, the decoder's positions).
        budget = max(1, self.tokens.output_budget(len(prompt), self.max_target_positions))
        out = []
        for w in windows:
            sp = SamplingParams(temperature=req.temperature, max_new_tokens=budget).normalize()
            out.append(GenerateRequest(input_ids=list(prompt), audio_data=[samples[w.start:w.end]], sampling_params=sp,
                                       return_logprob=True, stream=req.stream))
        return out

    async def respond(self, request: Request, req: TranscriptionRequest, plan: WhisperPlan, samples: np.ndarray,
                      rate: int, windows: list[AudioWindow]) -> Response:

        language = plan.language
        if language is None:
            language = await self._detect_language(request, samples[windows[0].start:windows[0].end])
        reqs = self._requests(req, plan, language, samples, windows)
        if req.stream:
            stream = await self.serving.serving._first_or_error(self.serving._stream(reqs))
            return StreamingResponse(stream, media_type="text/event-stream")
        outs = await self.serving.serving._collect_all(request, reqs)
        segments: list[dict] = []
        texts = []
        for w, out in zip(windows, outs):
            ids = list(out.output_ids)
            logprobs = [lp for lp, _ in out.output_logprobs]
            texts.append(self._text(ids))
            segments += self._segments(w, ids, logprobs, rate, req.temperature, len(segments))
        reported = language or ("en" if not self.tokens.lang_to_id else "unknown")
        task = "translate" if plan.task == "translate" else "transcribe"
        return render(req.response_format, join_transcripts(texts), segments, len(samples) / rate, reported, task)

    # ---- output ---------------------------------------------------------------------------------------------

    def _text(self, ids: list[int]) -> str:
        """Whisper's tokenizer drops special tokens and, with them skipped, timestamp tokens too."""
        return self.tm.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _segments(self, w: AudioWindow, ids: list[int], logprobs: list[float], rate: int, temperature: float,
                  first_id: int) -> list[dict]:

        offset = w.start / rate
        lo, hi = w.seconds(rate)
        out = []
        for seg in timed_segments(self.tokens, ids, (w.end - w.start) / rate):
            text = self.tm.tokenizer.decode(seg.tokens, skip_special_tokens=True)
            if not text.strip():
                continue
            start = min(max(offset + seg.start, lo), hi)
            end = min(max(offset + seg.end, start), hi)
            lps = logprobs[seg.span[0]:seg.span[1]]
            out.append({"id": first_id + len(out), "seek": w.start * 100 // rate,  # 10 ms mel frames
                        "start": round(start, 3), "end": round(end, 3), "text": text.strip(), "tokens": seg.tokens,
                        "temperature": temperature, "avg_logprob": float(np.mean(lps)) if lps else 0.0,
                        "compression_ratio": compression_ratio(text.strip()), "no_speech_prob": 0.0})
        return out
