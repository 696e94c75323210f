"""What each endpoint answers, declared for /openapi.json and /docs (`RESPONSES`, through request_models.route_docs).

The endpoints still write their answers as dicts (the bytes peers' clients are tested on); these models describe
those shapes, and tests/server/test_request_models.py checks real answers against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")  # every key an endpoint sends is documented (the test checks it)


class ErrorDetail(_Answer):
    message: str = Field(description="What was wrong; a field's error starts with its name.")
    type: str = Field(description="invalid_request_error, not_found_error, authentication_error, ...")
    param: str | None = Field(None, description="The request field at fault, when there is one.")
    code: int = Field(description="The HTTP status.")


class ErrorResponse(_Answer):
    """OpenAI's error shape, for every 4xx and 5xx (and a stream's last event when it fails after its start)."""

    error: ErrorDetail


class PromptTokensDetails(_Answer):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache.")


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class _Response(_Answer):
    id: str = Field(description="The response id; ends with the request's x-request-id.")
    object: str
    created: int = Field(description="Unix time, seconds.")
    model: str = Field(description="The served model's name.")


class ToolCallFunction(_Answer):
    name: str | None = None
    arguments: str = Field(description="The arguments as JSON text (streamed: a piece of it).")


class ToolCall(_Answer):
    index: int | None = Field(None, description="Streamed: the call's index among the choice's calls.")
    id: str | None = None
    type: str | None = "function"
    function: ToolCallFunction


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob]


class ChatMessage(_Answer):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class _Choice(_Answer):
    index: int
    logprobs: Any = Field(None, description="With logprobs: the chosen tokens' log-probabilities.")
    finish_reason: str | None = Field(description="stop, length, tool_calls, abort; null until the end.")
    matched_stop: str | int | None = Field(None, description="SGLang: the stop string or token id that ended it.")


class ChatChoice(_Choice):
    message: ChatMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="vLLM: with prompt_logprobs, per prompt token (null for the first).")


class ChatDelta(_Answer):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion (`data: {...}`; the stream ends with `data: [DONE]`)."""

    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="With stream_options.include_usage (the last chunk) or "
                                                  "continuous_usage_stats (every chunk).")


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(_Response):
    """The answer, or (with stream) each server-sent event's, which then carries one choice's new text."""

    choices: list[CompletionChoice]
    usage: Usage | None = None


class GenerateResponse(_Answer):
    """SGLang's /generate answer (a list of them for a batch; each event of a stream, ending with [DONE])."""

    text: str = Field(description="The text so far (streamed: all of it, not a delta).")
    output_ids: list[int]
    meta_info: dict[str, Any] = Field(description="SGLang's meta_info: id, finish_reason, prompt_tokens, "
                                                  "completion_tokens, cached_tokens, logprobs when asked, ...")
    index: int | None = Field(None, description="In a batch (or with n > 1): which output.")


class TokenizeResponse(_Answer):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None


class DetokenizeResponse(_Answer):
    prompt: str


class TranscriptionUsage(_Answer):
    type: str = "duration"
    seconds: int


class TranscriptionResponse(_Answer):
    """response_format json; verbose_json adds task, language, duration and segments (text, srt and vtt are
    plain text)."""

    text: str
    usage: TranscriptionUsage | None = None
    task: str | None = None
    language: str | None = None
    duration: float | None = None
    segments: list[dict[str, Any]] | None = None


class ModelCard(_Answer):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Answer):
    object: str = "list"
    data: list[ModelCard]


# path -> (the answer, the event of its stream when it has one)
class EmbeddingData(_Answer):
    object: Literal["embedding"]
    index: int = Field(description="Which input (or the one `messages` prompt) the vector is of.")
    embedding: list[float] | str = Field(description="The vector; with encoding_format base64, its little-endian "
                                                     "float32 bytes in base64.")


class EmbeddingUsage(_Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Answer):
    """OpenAI's embeddings answer."""

    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class LoraAdapterResponse(_Answer):
    """SGLang's answer to /load_lora_adapter and /unload_lora_adapter."""

    success: bool
    error_message: str = Field(description="Empty on success (a refusal is a 4xx error instead).")
    loaded_adapters: dict[str, str] = Field(description="Every loaded adapter's name -> its directory.")


RESPONSES: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk),
    "/v1/completions": (CompletionResponse, CompletionResponse),
    "/generate": (GenerateResponse, GenerateResponse),
    "/tokenize": (TokenizeResponse, None),
    "/detokenize": (DetokenizeResponse, None),
    "/v1/audio/transcriptions": (TranscriptionResponse, None),
    "/v1/audio/translations": (TranscriptionResponse, None),
    "/v1/models": (ModelList, None),
    "/v1/embeddings": (EmbeddingResponse, None),
    "/load_lora_adapter": (LoraAdapterResponse, None),
    "/unload_lora_adapter": (LoraAdapterResponse, None),
}
