"""How an audio chat model is asked for a transcript, how its answer reads, and which language is reported.

- Qwen3-ASR and GLM-ASR: the prompt is exactly what their transformers processor's `apply_transcription_request`
  builds (Qwen3-ASR: the request's `prompt` as the system context, and with a `language` the assistant turn
  prefilled with `language <Name><asr_text>`; GLM-ASR: its default instruction). Qwen3-ASR writes
  `language <Name><asr_text>transcript` when no language is given: the text after the marker is the transcript and
  the name is the detected language.
- Other audio chat models (Qwen2-Audio, demo-asr): the chat template with the audio followed by
  `Transcribe the audio.`, the request's `prompt` as the system message; the whole answer is the transcript.

verbose_json's `language` is, in order: the language the model wrote, the one the request named, the language
the checkpoint declares in generation_config.json (`"language"`, as demo-asr's: it is trained on English only), or
"unknown".
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from tessera.entrypoints.openai.errors import APIError

TRANSCRIBE_INSTRUCTION = "Transcribe the audio."
ASR_TEXT_MARKER = "<asr_text>"
_LANGUAGE_PREFIX = "language "


class TranscriptionStyle:
    """The chat-instruction style (Qwen2-Audio, demo-asr)."""


    def __init__(self, info: Any, hf_processor: Any):
        self.info = info
        self.hf_processor = hf_processor

    @staticmethod
    def of(info: Any, hf_processor: Any) -> TranscriptionStyle:
        if hasattr(hf_processor, "apply_transcription_request"):
            cls = MarkedTranscriptRequest if hasattr(hf_processor, "parse_output") else TranscriptRequest
            return cls(info, hf_processor)
        return TranscriptionStyle(info, hf_processor)

    def prompt(self, language: str | None, prompt: str | None) -> str:
        messages: list[dict] = [{"role": "system", "content": prompt}] if prompt else []
        messages.append({"role": "user", "content": [{"type": "audio"},
                                                     {"type": "text", "text": TRANSCRIBE_INSTRUCTION}]})
        return self.info.apply_chat_template(messages, add_generation_prompt=True)

    def marker(self, requested: str | None) -> str | None:
        """The marker the transcript follows in the model's answer to a request naming `requested`, if any."""
        return None

    def split(self, text: str, requested: str | None) -> tuple[str, str | None]:
        """(transcript, the language the model wrote or None) of one window's answer."""
        marker = self.marker(requested)
        if marker is None or marker not in text:
            return text.strip(), None
        head, transcript = text.split(marker, 1)
        return transcript.strip(), self.written_language(head.strip())

    def written_language(self, head: str) -> str | None:
        """The language named by the answer's part before the marker."""
        return None

    def reported_language(self, written: list[str | None], requested: str | None) -> str:
        """verbose_json's language: the most common one the windows wrote, else the request's, else the
        checkpoint's declared language, else "unknown"."""
        found = [w for w in written if w]
        if found:
            return Counter(found).most_common(1)[0][0]
        declared = self.info.config.generation_config.get("language")
        return requested or (str(declared) if declared else "unknown")


class TranscriptRequest(TranscriptionStyle):
    """A processor with `apply_transcription_request` (GLM-ASR): its prompt, without the audio loaded."""

    def request_kwargs(self, language: str | None, prompt: str | None) -> dict:
        return {}

    def prompt(self, language: str | None, prompt: str | None) -> str:
        kwargs = self.request_kwargs(language, prompt)
        silence = np.zeros(1, np.float32)  # not loaded: only the prompt's text is built
        if not prompt or "prompt" in kwargs:
            return self.hf_processor.apply_transcription_request(silence, tokenize=False, **kwargs)[0]
        # GLM-ASR's request has no context slot (its `prompt` is the instruction): the context leads as a system
        # turn before the request's own user turn.
        instruction = self.hf_processor.default_transcription_prompt
        messages = [{"role": "system", "content": [{"type": "text", "text": prompt}]},
                    {"role": "user", "content": [{"type": "audio", "audio": silence},
                                                 {"type": "text", "text": instruction}]}]
        return self.hf_processor.apply_chat_template([messages], tokenize=False, add_generation_prompt=True)[0]


class MarkedTranscriptRequest(TranscriptRequest):
    """Qwen3-ASR: `language <Name><asr_text>transcript`; a request's language is forced by prefilling it."""

    def request_kwargs(self, language: str | None, prompt: str | None) -> dict:
        from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

        if language is not None and language.split("-")[0].lower() not in LANGUAGE_CODE_TO_NAME:
            raise APIError(f"language: {self.info.architecture} transcribes "
                           f"{', '.join(sorted(LANGUAGE_CODE_TO_NAME))}, not {language!r}", param="language")
        return {"language": None if language is None else language.split("-")[0].lower(), "prompt": prompt}

    def marker(self, requested: str | None) -> str | None:
        return ASR_TEXT_MARKER if requested is None else None  # a forced language: the prompt holds the marker

    def written_language(self, head: str) -> str | None:
        return language_code(head[len(_LANGUAGE_PREFIX):].strip() if head.startswith(_LANGUAGE_PREFIX) else head)


def language_code(name: str) -> str | None:
    """ISO-639-1 code of a language name Qwen3-ASR writes ("English" -> "en"); the name in lower case when it
    has no code in transformers' table; None for "None" (Qwen3-ASR's answer for audio without speech)."""
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    if not name or name.lower() == "none":
        return None
    codes = {v.lower(): k for k, v in LANGUAGE_CODE_TO_NAME.items()}
    return codes.get(name.lower(), name.lower())
