"""GenerateRequest: the frontend's typed form of one generate call (Engine or HTTP), and the errors a request
ends with (its answer: frontend/result.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams


@dataclass
class GenerateRequest:
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    image_data: list[Any] | None = None
    video_data: list[Any] | None = None
    audio_data: list[Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    # SGLang's: >= 0 also returns the prompt tokens' logprobs from this position on (-1: none).
    logprob_start_len: int = -1
    # With prompt logprobs, also each prompt token's rank (vLLM's prompt_logprobs report it; it costs about a
    # second log_softmax over the rows, so only when asked).
    prompt_logprob_ranks: bool = False
    # OpenAI semantics when max_tokens is omitted: as many as the context leaves room for.
    auto_max_new_tokens: bool = False
    # vLLM's cache_salt: only requests with the same salt share prefix-cache entries.
    cache_salt: str | None = None
    # This request's video frame sampling (num_frames, fps, max_frames), over the server's --mm-process-config.
    video_kwargs: dict[str, Any] | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # SGLang's lora_path: the name of a loaded LoRA adapter to run this request with (None: the base model).
    lora_path: str | None = None
    # An embedding request (frontend/embedding.py): prefill only, answered with its pooled vector.
    pooling: PoolingParams | None = None
    add_special_tokens: bool = False  # tokenize `text` with the tokenizer's special tokens (embeddings do)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("prompt: give exactly one of a text prompt or input_ids")
        if self.text is not None and not isinstance(self.text, str):
            raise ValueError(f"prompt: expected a string, got {type(self.text).__name__}")
        if self.input_ids is not None:
            if not isinstance(self.input_ids, list) or not all(isinstance(i, int) for i in self.input_ids):
                raise ValueError("input_ids: expected a list of integers")
        if isinstance(self.logprob_start_len, bool) or not isinstance(self.logprob_start_len, int) or \
                self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len: must be an integer >= -1, got {self.logprob_start_len!r}")
        for name in ("image_data", "video_data", "audio_data"):
            val = getattr(self, name)
            if val is not None and not isinstance(val, list):
                setattr(self, name, [val])

    @property
    def has_media(self) -> bool:
        return bool(self.image_data or self.video_data or self.audio_data)


class EngineUnavailable(RuntimeError):
    """No scheduler can serve the request (still loading, or its process died): HTTP 503, message public."""

    status = 503
    public = True


class RequestFailed(RuntimeError):
    """The scheduler failed this request (a model-step error); the details stay in the server log: HTTP 500."""

    status = 500


@dataclass(frozen=True)
class FrontendStats:
    """Counters of the frontend process (the scheduler's are messages.SchedulerStats).

    preprocess_cache_misses counts the media items that went through the HF image/video
    processor; hits, those served from the preprocessing cache. Zero for text-only models.
    """

    preprocess_cache_hits: int = 0
    preprocess_cache_misses: int = 0
    preprocess_cache_bytes: int = 0
    preprocess_cache_entries: int = 0

