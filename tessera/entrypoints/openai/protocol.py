"""The OpenAI requests (parsed at the edge: request_models.py) mapped to Tessera's types, with errors that name
the field: `sampling_params_from_openai` is the one mapping to SamplingParams, `parse_chat_messages` turns chat
messages into the template's messages and the media.

Nothing is silently ignored: a field is either accepted (and does what OpenAI, vLLM or SGLang
document) or refused with a 400 that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.constrained.grammar import CONSTRAINT_FIELDS
from tessera.entrypoints.openai.errors import APIError, param_of
from tessera.entrypoints.openai.request_models import ChatCompletionRequest, CompletionRequest
from tessera.entrypoints.openai.response_format import constraint_from_openai
from tessera.messages.sampling import SamplingParams

# OpenAI name -> SamplingParams name (vLLM's and SGLang's extensions too); a later name wins over an earlier one.
_TO_SP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n": "n",
          "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed",
          "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "top_k": "top_k",
          "min_p": "min_p", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
          "skip_special_tokens": "skip_special_tokens", "spaces_between_special_tokens": "spaces_between_special_tokens",
          "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens", "no_stop_trim": "no_stop_trim",
          "include_stop_str_in_output": "no_stop_trim", "speculative": "speculative"}
INT64 = (-(1 << 63), (1 << 63) - 1)
# vLLM's constraint fields (guided_* and the newer structured_outputs keys) -> SGLang's, which we implement.
_VLLM_CONSTRAINTS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf",
                     "guided_choice": "regex"}
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
                       "choice": "guided_choice"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
OpenAIRequest = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class StreamOptions:
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk (vLLM's stream_options.continuous_usage_stats)


def stream_options(req: OpenAIRequest) -> StreamOptions:
    opts = req.stream_options
    if opts is None:
        return StreamOptions(bool(req.stream))
    if not req.stream:
        raise APIError("stream_options: only allowed when stream is true", param="stream_options")
    include = bool(opts.include_usage)
    return StreamOptions(True, include, include and bool(opts.continuous_usage_stats))


def user_names(req: OpenAIRequest) -> dict[str, str]:
    """SamplingParams names -> the names this request used, for error messages."""
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    names = {"max_new_tokens": max_name, "min_new_tokens": "min_tokens",
             "top_logprobs_num": "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"}
    if req.include_stop_str_in_output is not None:
        names["no_stop_trim"] = "include_stop_str_in_output"
    return names


def renamed_error(exc: Exception, names: dict[str, str]) -> APIError:
    """A ValueError of SamplingParams/TokenizerManager ("max_new_tokens must be ...") with the user's field
    names, as an APIError that keeps the exception's status (422 for unfetchable media)."""
    message = str(exc)
    param = param_of(message)
    for internal, user in names.items():
        if message.startswith(internal):
            param = user
        message = message.replace(internal, user)
    return APIError(message, status=getattr(exc, "status", 400), param=param)


def logit_bias_of(value: dict[str, float] | None) -> dict[int, float] | None:
    if value is None:
        return None
    out = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not math.isfinite(bias):
            raise APIError(f"logit_bias: the bias of {key} must be a number, got {bias!r}", param="logit_bias")
        out[token_id] = float(bias)
    return out


def sampling_params_from_openai(req: OpenAIRequest, default_max_tokens: int,
                                vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams of an OpenAI request, verified; errors name the fields the body used."""
    kw: dict[str, Any] = {dst: getattr(req, src) for src, dst in _TO_SP.items() if getattr(req, src) is not None}
    kw.setdefault("max_new_tokens", default_max_tokens)
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise APIError(f"seed: must fit in a signed 64-bit integer, got {req.seed}", param="seed")
    kw["logit_bias"] = logit_bias_of(req.logit_bias)
    kw.update(constraint_from_openai(sglang_constraints(req)))  # response_format / regex / ebnf / json_schema
    if isinstance(req, ChatCompletionRequest):
        kw["logprobs"] = bool(req.logprobs)
        if req.top_logprobs not in (None, 0):  # 0: vLLM's default, sent by its clients without logprobs
            if not req.logprobs:
                raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
            kw["top_logprobs_num"] = req.top_logprobs
    elif req.logprobs is not None:
        kw["logprobs"], kw["top_logprobs_num"] = True, req.logprobs
    try:
        sp = SamplingParams(**kw).normalize()
        sp.verify(vocab_size)
    except (TypeError, ValueError) as e:
        raise renamed_error(e, user_names(req)) from None
    return sp


def sglang_constraints(req: OpenAIRequest) -> dict:
    """The request's output constraint under SGLang's names (and response_format): vLLM's guided_json, regex,
    grammar and choice (or structured_outputs) renamed; guided_choice becomes a regex that matches exactly one of
    the choices."""
    body = {name: getattr(req, name) for name in ("response_format", *CONSTRAINT_FIELDS)}
    vllm = {k: getattr(req, k) for k in _VLLM_CONSTRAINTS if getattr(req, k) is not None}
    if req.structured_outputs is not None:
        vllm.update({_STRUCTURED_OUTPUTS[k]: v for k, v in req.structured_outputs.model_dump(by_alias=True).items()
                     if v is not None})
    if not vllm:
        return body
    if len(vllm) > 1:
        raise APIError(f"{sorted(vllm)[1]}: only one output constraint per request", param=sorted(vllm)[1])
    (name, value), = vllm.items()
    if name == "guided_choice":
        if not value or not all(value):
            raise APIError("guided_choice: must be a non-empty list of non-empty strings", param="guided_choice")
        value = "|".join("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in value)
    target = _VLLM_CONSTRAINTS[name]
    if body[target] is not None:
        raise APIError(f"{name}: give either {name} or {target}, not both", param=name)
    return {**body, target: value}


def _media_url(part: dict, key: str, where: str) -> str:
    val = part.get(key)
    if not isinstance(val, dict):
        raise APIError(f"{where}.{key}: must be an object {{\"url\": ...}}", param=f"messages.content.{key}")
    url = val.get("url")
    if not isinstance(url, str) or not url:
        raise APIError(f"{where}.{key}.url: must be a non-empty string", param=f"messages.content.{key}")
    return url


def parse_chat_messages(messages: list[dict]) -> tuple[list[dict], list[Any], list[Any], list[Any]]:
    """Returns (template messages, images, videos, audios) in prompt order.

    Template messages use the HF content-part form ({"type": "image"} etc.) that chat templates
    expect; the media values go to the multimodal loader untouched (URL, data URI, path, base64).
    An assistant message's tool_calls and a tool message's tool_call_id are kept for the template.
    """
    out, images, videos, audios = [], [], [], []
    for i, msg in enumerate(messages):
        if "role" not in msg:
            raise APIError(f"messages[{i}]: each message needs a role", param="messages")
        role = msg["role"]
        # Other roles go to the chat template as written (vLLM's custom roles); a template that rejects one
        # is a 400 from the template.
        if not isinstance(role, str) or not role.strip():
            raise APIError(f"messages[{i}].role: must be a non-empty string", param="messages")
        role = "system" if role == "developer" else role
        extra = _tool_fields(msg, i)
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise APIError(f"messages[{i}].content: must be a string or a list of parts", param="messages")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict) or "type" not in part:
                raise APIError(f"{where}: each part needs a type", param="messages")
            kind = part["type"]
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise APIError(f"{where}.text: must be a string", param="messages")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                images.append(_media_url(part, "image_url", where))
                parts.append({"type": "image"})
            elif kind == "video_url":
                videos.append(_media_url(part, "video_url", where))
                parts.append({"type": "video"})
            elif kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise APIError(f"{where}.input_audio: needs base64 data", param="messages")
                # OpenAI's input_audio is base64 only: as a data URI it is never taken for a path or URL
                fmt = audio.get("format") if isinstance(audio.get("format"), str) else "wav"
                audios.append(f"data:audio/{fmt};base64,{audio['data']}")
                parts.append({"type": "audio"})
            elif kind == "audio_url":
                audios.append(_media_url(part, "audio_url", where))
                parts.append({"type": "audio"})
            else:
                raise APIError(f"{where}.type: unsupported part type {kind!r}", param="messages")
        out.append({"role": role, "content": parts, **extra})
    return out, images, videos, audios


def _tool_fields(msg: dict, i: int) -> dict:
    """tool_calls of an assistant message (arguments decoded for templates that render them as JSON) and
    the tool_call_id/name of a tool message."""
    extra: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        import json

        if not isinstance(calls, list):
            raise APIError(f"messages[{i}].tool_calls: must be a list", param="messages")
        rendered = []
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(f"messages[{i}].tool_calls[{k}]: needs function.name", param="messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except json.JSONDecodeError:
                    pass  # a call max_tokens cut short, sent back as the client got it: rendered as written
            rendered.append({"id": call.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": args}})
        extra["tool_calls"] = rendered
    for key in ("tool_call_id", "name"):
        if isinstance(msg.get(key), str):
            extra[key] = msg[key]
    return extra
