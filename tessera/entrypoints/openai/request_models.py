"""Every request body the server takes, declared once: each field's type, default and meaning.

Each endpoint's body is parsed once, at the edge (`parse`, called by the route in http_server.py), into its model:
an unknown field, a peer's field past its no-op value (peer_fields.py) or a value of the wrong type is a 400 in
OpenAI's error shape that names the field; everything below reads the typed request. The models are strict (no
coercion: "1" is not an integer, 1 is not a boolean), as the hand-written checks they replace were. The fields
SGLang and vLLM declare that Tessera takes only at their no-op values are added to each model, marked so, and
/openapi.json and /docs show every model as its route's request body (`route_docs`).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.peer_fields import GENERATE_NOOPS, OPENAI_NOOPS, refusal
from tessera.entrypoints.openai.response_models import RESPONSES, ErrorResponse

Stop = str | list[str] | None
Media = str | list[Any] | dict[str, Any] | None
Salt = str | None
Body = TypeVar("Body", bound="_Body")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # any other field is refused (400 naming it)
    # Fields taken only at their no-op values: name -> (those values, why any other is refused).
    noops: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}


class _StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="A last chunk with the usage of the whole request.")
    continuous_usage_stats: bool | None = Field(None, description="vLLM: usage in every chunk (with include_usage).")


class _VideoIO(_Body):
    num_frames: int | None = Field(None, gt=0, description="Frames sampled from the video.")
    fps: float | None = Field(None, gt=0, description="Frames sampled per second.")
    max_frames: int | None = Field(None, gt=0, description="At most this many frames.")


class _StructuredOutputs(_Body):
    json_: str | dict[str, Any] | None = Field(None, alias="json", description="The output is JSON of this schema.")
    regex: str | None = Field(None, description="The output matches this regular expression.")
    grammar: str | None = Field(None, description="The output follows this EBNF (or GBNF) grammar.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")


class _Sampling(_Body):
    """The sampling fields both OpenAI endpoints take (OpenAI's, and vLLM's and SGLang's extensions)."""

    model: str | None = Field(None, description="The served model's name (`--served-model-name`); optional.")
    stream: bool | None = Field(False, description="Stream the answer as server-sent events, ending with [DONE].")
    stream_options: _StreamOptions | None = Field(None, description="With stream: what the chunks report.")
    user: str | None = Field(None, description="OpenAI's end-user id; accepted, changes nothing.")
    safety_identifier: str | None = Field(None, description="OpenAI's end-user id (user's successor); accepted, "
                                                            "changes nothing.")
    metadata: dict[str, str] | None = Field(None, description="OpenAI's tags for stored completions; accepted, "
                                                              "changes nothing (nothing is stored).")
    prompt_cache_key: str | None = Field(None, description="OpenAI's prompt-cache routing hint; accepted: the radix "
                                                           "cache reuses any shared prefix, and sglang-router's "
                                                           "cache-aware policy routes on the prompt itself.")
    max_tokens: int | None = Field(None, description="Most new tokens (default: what fits the context).")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens.")
    n: int | None = Field(1, description="Choices to sample for the prompt.")
    temperature: float | None = Field(None, description="Sampling temperature; 0 is greedy (default 1).")
    top_p: float | None = Field(None, description="Nucleus sampling mass (default 1).")
    top_k: int | None = Field(None, description="Sample among the k most likely tokens (-1 or 0: all).")
    min_p: float | None = Field(None, description="Drop tokens below min_p times the top token's probability.")
    stop: Stop = Field(None, description="Stop strings (up to 4 in OpenAI's API); cut from the text.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the answer.")
    seed: int | None = Field(None, description="Per-request seed: the same seed gives the same sample.")
    frequency_penalty: float | None = Field(None, description="Penalty per earlier occurrence of a token.")
    presence_penalty: float | None = Field(None, description="Penalty for a token that occurred at all.")
    repetition_penalty: float | None = Field(None, description="CTRL's multiplicative repetition penalty.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias added to its logit.")
    min_tokens: int | None = Field(None, description="No stop before this many new tokens.")
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-sequence tokens.")
    skip_special_tokens: bool | None = Field(None, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool | None = Field(None, description="Spaces around special tokens.")
    no_stop_trim: bool | None = Field(None, description="SGLang: keep the matched stop string in the text.")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's name for no_stop_trim.")
    echo: bool | None = Field(None, description="Return the prompt in front of the answer.")
    speculative: bool | None = Field(None, description="Tessera: false opts out of the server's speculative "
                                                       "decoding (same tokens, plain decode steps).")
    prompt_logprobs: int | None = Field(None, description="vLLM: log-probabilities of the prompt's tokens.")
    cache_salt: Salt = Field(None, min_length=1, description="Separates this request's cached prefixes from others'.")
    lora_path: str | None = Field(None, description="SGLang: a loaded LoRA adapter's name (or model 'base:adapter').")
    response_format: dict[str, Any] | None = Field(
        None, description="`{type: json_object}` or `{type: json_schema, json_schema: {...}}`: constrained output.")
    regex: str | None = Field(None, description="SGLang: the output matches this regular expression.")
    ebnf: str | None = Field(None, description="SGLang: the output follows this EBNF (or GBNF) grammar.")
    json_schema: str | dict[str, Any] | None = Field(None, description="SGLang: the output is JSON of this schema.")
    structured_outputs: _StructuredOutputs | None = Field(
        None, description="vLLM: one of json, regex, grammar, choice.")
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's older name for a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM's older name for a regex constraint.")
    guided_grammar: str | None = Field(None, description="vLLM's older name for a grammar constraint.")
    guided_choice: list[str] | None = Field(None, description="vLLM: the output is one of these strings.")
    # Refused beyond their no-op values (peer_fields.OPENAI_NOOPS).
    guided_decoding_backend: str | None = Field(None, description="Refused: the backend is fixed (llguidance).")
    guided_whitespace_pattern: str | None = Field(None, description="Refused: JSON output is compact.")
    structural_tag: Any = Field(None, description="Refused: structural tags are not supported.")
    use_beam_search: bool | None = Field(False, description="Refused: beam search is not supported.")


class _ChatFields(_Sampling):
    messages: list[dict[str, Any]] = Field(
        min_length=1, description="OpenAI chat messages; user content may hold text, image_url, video_url, input_audio and "
                    "audio_url parts.")
    logprobs: bool | None = Field(None, description="Return the chosen tokens' log-probabilities.")
    top_logprobs: int | None = Field(None, description="With logprobs: this many alternatives per token.")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto, required or one function.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several tool calls in one answer.")
    continue_final_message: bool | None = Field(None, description="Continue the last assistant message.")
    add_generation_prompt: bool | None = Field(None, description="End the prompt with the assistant's turn.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    media_io_kwargs: dict[Literal["video"], _VideoIO | None] | None = Field(
        None, description="vLLM: how videos are sampled, `{\"video\": {num_frames, fps, max_frames}}`.")
    functions: Any = Field(None, description="Refused: the legacy functions API; use tools.")
    function_call: Any = Field(None, description="Refused: the legacy functions API; use tool_choice.")


class _CompletionFields(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A prompt, a batch of prompts, or token ids (one list, or a list of lists).")
    logprobs: int | None = Field(None, description="This many alternatives per chosen token.")
    suffix: str | None = Field(None, description="Refused: insertion (fill-in-the-middle) is not supported.")
    best_of: int | None = Field(None, description="Only best_of == n is supported (every sample is returned).")


class _GenerateFields(_Body):
    """SGLang's native /generate (its GenerateReqInput)."""

    model: str | None = Field(None, description="The served model's name, as routers add it (null: the served model; "
                                                "'base:adapter' runs a LoRA adapter); optional.")
    text: str | list[str] | None = Field(None, description="The prompt, or a batch of prompts.")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="Token ids instead of text.")
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="SGLang's sampling parameters (max_new_tokens, temperature, stop, ...); one per prompt "
                          "or shared.")
    image_data: Media = Field(None, description="Images: paths, URLs, base64, data URIs; per prompt in a batch.")
    video_data: Media = Field(None, description="Videos, as image_data.")
    audio_data: Media = Field(None, description="Audio clips, as image_data.")
    stream: bool | None = Field(False, description="Stream server-sent events, ending with [DONE].")
    rid: str | list[str] | None = Field(None, description="Request id(s).")
    return_logprob: bool | list[bool] | None = Field(None, description="Return log-probabilities.")
    top_logprobs_num: int | list[int] | None = Field(None, description="Alternatives per position.")
    logprob_start_len: int | list[int] | None = Field(None, description="From this prompt position (-1: output).")
    return_text_in_logprobs: bool | None = Field(False, description="Token text beside each log-probability.")
    modalities: list[Literal["image", "multi-images", "video", "audio"]] | None = Field(
        None, description="What the media are, per item.")
    cache_salt: Salt = Field(None, min_length=1, description="Separates this request's cached prefixes from others'.")
    lora_path: str | list[str | None] | None = Field(
        None, description="A loaded LoRA adapter's name, or one per prompt (None: the base model).")


class LoadLoraAdapterRequest(_Body):
    """SGLang's /load_lora_adapter."""

    lora_name: str = Field(description="The adapter's name: requests name it as lora_path or model 'base:name'.")
    lora_path: str = Field(description="Its directory (PEFT's adapter_config.json + adapter_model.safetensors).")
    pinned: bool | None = Field(None, description="SGLang's; accepted, changes nothing (eviction is LRU).")


class UnloadLoraAdapterRequest(_Body):
    """SGLang's /unload_lora_adapter."""

    lora_name: str = Field(description="A loaded adapter's name.")


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: str | None = Field(None, description="The served model's name; optional.")
    prompt: str | None = Field(None, description="Text to tokenize (or messages).")
    messages: list[dict[str, Any]] | None = Field(None, min_length=1,
                                                  description="Chat messages, rendered by the template.")
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens.")
    add_generation_prompt: bool | None = Field(None, description="End with the assistant's turn.")
    continue_final_message: bool | None = Field(None, description="Continue the last assistant message.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra template variables.")
    return_token_strs: bool | None = Field(None, description="Also return each token's string.")


class DetokenizeRequest(_Body):
    model: str | None = Field(None, description="The served model's name; optional.")
    tokens: list[int] = Field(description="Token ids to turn back into text.")


class TranscriptionRequest(_Body):
    """OpenAI's /v1/audio/transcriptions and /translations, a multipart form (read by transcriptions.py)."""

    model_config = ConfigDict(extra="forbid", strict=False)  # a form's values are text

    file: bytes = Field(description="The audio file (wav, flac, ogg, mp3, m4a, ...).")
    model: str = Field(description="The served model's name.")
    language: str | None = Field(None, description="The spoken language (ISO-639-1), where the model takes it.")
    prompt: str | None = Field(None, description="Text that precedes the audio.")
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = Field(
        "json", description="The answer's shape.")
    temperature: float = Field(0.0, ge=0, le=2, allow_inf_nan=False, description="Sampling temperature (0: greedy).")
    stream: bool = Field(False, description="Stream the text as server-sent events (json and text only).")
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        None, alias="timestamp_granularities[]", description="verbose_json: segment (word is refused).")
    include: list[str] | None = Field(None, alias="include[]", description="OpenAI's extra outputs; accepted, "
                                                                             "changes nothing.")
    chunking_strategy: str | dict[str, Any] | None = Field(
        None, description="OpenAI's server-side chunking; accepted: long audio is cut at quiet points anyway.")


def _with_peers(name: str, base: type[BaseModel], table: dict[str, tuple[tuple[Any, ...], str]]) -> type[_Body]:
    """`base` plus the peers' fields of `table` it does not declare, each marked as a no-op field."""
    extra = {}
    for field, (noops, why) in table.items():
        if field in base.model_fields:
            continue
        values = ", ".join(["null", *(repr(v) for v in noops)])
        extra[field] = (Any, Field(None, description=f"SGLang/vLLM field, accepted only as {values}: {why}."))
    model = create_model(name, __base__=base, **extra)
    model.noops = table
    return model


ChatCompletionRequest = _with_peers("ChatCompletionRequest", _ChatFields, OPENAI_NOOPS)
CompletionRequest = _with_peers("CompletionRequest", _CompletionFields, OPENAI_NOOPS)
GenerateRequest = _with_peers("GenerateRequest", _GenerateFields, GENERATE_NOOPS)


def honoured(model: type[_Body]) -> frozenset[str]:
    """The fields the endpoint acts on: its declared fields but those taken only at a no-op value."""
    return frozenset(name for name in model.model_fields if name not in model.noops)


FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def parse_json_body(path: str, raw: bytes, content_type: str) -> BaseModel:
    """A JSON endpoint's raw body, parsed once into its model (REQUEST_BODIES[path]); a 400 names what is wrong."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in FORM_TYPES:
        raise APIError(f"Content-Type: {ctype} is not accepted here; send the JSON body as application/json",
                       status=400, param="Content-Type")
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise APIError("body: expected a JSON object")
    return parse(REQUEST_BODIES[path][0], body)


def parse(model: type[Body], body: dict) -> Body:
    """The body as `model`: an APIError (400) naming the first field that is unknown, refused or invalid."""
    for name, value in body.items():  # in the body's order, before the types: as the clients wrote it
        if name not in model.model_fields:
            raise APIError(f"{name}: unknown parameter", param=name)
        why = refusal(name, value, model.noops) if name in model.noops else None
        if why is not None:
            raise APIError(f"{name}: {why} (accepted only at its no-op value)", param=name)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise field_error(e.errors(include_url=False)) from None


def field_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one 400 that names the first field: "stop_token_ids[1]: Input should be ...". A
    value that fits none of a union's types reports each type's complaint."""
    name = str(errors[0]["loc"][0]).removesuffix("[]") if errors[0]["loc"] else "body"  # a form's list field
    same = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    if len(same) > 1:
        return APIError(f"{name}: " + "; or ".join(dict.fromkeys(e["msg"] for e in same)), param=name)
    err = errors[0]
    where = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"][1:])
    if err["type"] == "extra_forbidden":
        return APIError(f"{where}: unknown field", param=name)
    got = "" if err["type"] == "missing" else f", got {repr(err['input'])[:80]}"
    return APIError(f"{where}: {err['msg']}{got}", param=name)


def _inlined(schema: dict) -> dict:
    """A model's JSON schema with its $defs written in place (an operation's schema cannot point into them)."""
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk({**defs[ref.split("/")[-1]], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


# What each endpoint honours (the peer-fields test compares them with SGLang's and vLLM's models).
CHAT_FIELDS, COMPLETION_FIELDS = honoured(ChatCompletionRequest), honoured(CompletionRequest)
GENERATE_FIELDS = honoured(GenerateRequest)
TRANSCRIPTION_FIELDS = frozenset(f.alias or name for name, f in TranscriptionRequest.model_fields.items())

# path -> (model, content type), for /openapi.json
REQUEST_BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "application/json"),
    "/v1/completions": (CompletionRequest, "application/json"),
    "/generate": (GenerateRequest, "application/json"),
    "/tokenize": (TokenizeRequest, "application/json"),
    "/detokenize": (DetokenizeRequest, "application/json"),
    "/v1/audio/transcriptions": (TranscriptionRequest, "multipart/form-data"),
    "/v1/audio/translations": (TranscriptionRequest, "multipart/form-data"),
    "/load_lora_adapter": (LoadLoraAdapterRequest, "application/json"),
    "/unload_lora_adapter": (UnloadLoraAdapterRequest, "application/json"),
}


def openapi_body(path: str) -> dict:
    """The route's `openapi_extra`: its request body's schema from its model."""
    model, content_type = REQUEST_BODIES[path]
    return {"requestBody": {"required": True, "content": {content_type: {"schema": _inlined(
        model.model_json_schema(by_alias=True))}}}}


def route_docs(path: str) -> dict:
    """The route's decorator arguments that document it in /openapi.json: its request body (REQUEST_BODIES), its
    answer and its stream's event (response_models.RESPONSES), and OpenAI's error shape."""
    error = {"model": ErrorResponse}
    responses: dict[int | str, dict] = {400: {**error, "description": "Bad input: the message names the field."},
                                        404: {**error, "description": "No such model."},
                                        503: {**error, "description": "Loading, overloaded or shutting down."}}
    answer, event = RESPONSES.get(path, (None, None))  # a route without one yet: the test of the spec says so
    if answer is not None:
        responses[200] = {"model": answer, "description": "The answer."}
    if event is not None:
        responses[200]["description"] = "The answer; with stream, server-sent events (`data: {...}`, each one " \
                                        "event as below), the last `data: [DONE]`."
        responses[200]["content"] = {"text/event-stream": {"schema": _inlined(event.model_json_schema())}}
    docs: dict = {"responses": responses}
    if path in REQUEST_BODIES:
        docs["openapi_extra"] = openapi_body(path)
    return docs
