"""Parsing of OpenAI request bodies into Tessera's types, with errors that name the field.

Nothing is silently ignored: a field is either accepted (and does what OpenAI, vLLM or SGLang
document) or refused with a 400 that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from tessera.entrypoints.openai.errors import APIError, param_of
from tessera.entrypoints.openai import request_models
from tessera.entrypoints.openai.peer_fields import OPENAI_NOOPS, refusal
from tessera.entrypoints.openai.response_format import constraint_from_openai
from tessera.messages.sampling import SamplingParams

# OpenAI name -> SamplingParams name; vLLM/SGLang extras pass through under their own names.
_OPENAI_TO_SP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n": "n",
                 "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
_EXTRAS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
           "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
           "spaces_between_special_tokens": "spaces_between_special_tokens", "stop_token_ids": "stop_token_ids",
           "min_tokens": "min_new_tokens", "no_stop_trim": "no_stop_trim",
           "include_stop_str_in_output": "no_stop_trim"}
INT64 = (-(1 << 63), (1 << 63) - 1)
# vLLM's constraint fields (guided_* and the newer structured_outputs keys) -> SGLang's, which we implement.
_VLLM_CONSTRAINTS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf",
                     "guided_choice": "regex"}
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
                       "choice": "guided_choice"}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")

# Known fields that are refused: (the value that is accepted as a no-op, why the rest is refused).
_REFUSED: dict[str, tuple[Any, str]] = {
    "guided_decoding_backend": (None, "the constrained-decoding backend is fixed (llguidance)"),
    "guided_whitespace_pattern": (None, "JSON output is compact; a whitespace pattern is not supported"),
    "structural_tag": (None, "structural tags are not supported; use response_format, regex, ebnf or json_schema"),
    "use_beam_search": (False, "beam search is not supported"),
    "functions": (None, "the legacy functions API is not supported; use tools"),
    "function_call": (None, "the legacy functions API is not supported; use tool_choice"),
}


# What each endpoint honours: its declared fields (request_models.py: types and meanings) but the refused ones.
CHAT_FIELDS = request_models.CHAT_DECLARED - set(_REFUSED)
COMPLETION_FIELDS = request_models.COMPLETION_DECLARED - set(_REFUSED)


def check_fields(body: dict, accepted: set[str]) -> None:
    """400 for a refused field set to anything but its no-op value (here or a peer's, peer_fields.py), and for
    any unknown field."""
    for name, value in body.items():
        if name in _REFUSED:
            noop, why = _REFUSED[name]
            if value is not None and value != noop:
                raise APIError(f"{name}: {why}", param=name)
        elif name in accepted:
            continue
        elif name in OPENAI_NOOPS:
            why = refusal(name, value, OPENAI_NOOPS)
            if why is not None:
                raise APIError(f"{name}: {why} (accepted only at its no-op value)", param=name)
        else:
            raise APIError(f"{name}: unknown parameter", param=name)
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n", 1):
        raise APIError("best_of: only best_of == n is supported (every sample is returned)", param="best_of")
    if body.get("suffix"):
        raise APIError("suffix: insertion (fill-in-the-middle) is not supported", param="suffix")


@dataclass(frozen=True)
class StreamOptions:
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk (vLLM's stream_options.continuous_usage_stats)


def stream_options(body: dict) -> StreamOptions:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError("stream: must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return StreamOptions(bool(stream))
    if not stream:
        raise APIError("stream_options: only allowed when stream is true", param="stream_options")
    if not isinstance(opts, dict):
        raise APIError("stream_options: must be an object", param="stream_options")
    unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise APIError(f"stream_options.{unknown[0]}: unknown option", param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):
        if opts.get(key) is not None and not isinstance(opts[key], bool):
            raise APIError(f"stream_options.{key}: must be a boolean", param="stream_options")
    include = bool(opts.get("include_usage"))
    return StreamOptions(True, include, include and bool(opts.get("continuous_usage_stats")))


def user_names(body: dict, chat: bool) -> dict[str, str]:
    """SamplingParams names -> the names this request used, for error messages."""
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_new_tokens": max_name, "min_new_tokens": "min_tokens",
             "top_logprobs_num": "top_logprobs" if chat else "logprobs"}
    if body.get("include_stop_str_in_output") is not None:
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


def logit_bias_of(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError("logit_bias: must be a map of token id (string) to bias", param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise APIError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not isinstance(bias, Real) or isinstance(bias, bool) or not math.isfinite(bias):
            raise APIError(f"logit_bias: the bias of {key} must be a number, got {bias!r}", param="logit_bias")
        out[token_id] = float(bias)
    return out


def sampling_params_from_openai(body: dict, default_max_tokens: int, vocab_size: int | None = None,
                                chat: bool = True) -> SamplingParams:
    """SamplingParams of an OpenAI body, verified; errors name the fields the body used."""
    kw: dict[str, Any] = {}
    for src, dst in _OPENAI_TO_SP.items():
        if body.get(src) is not None:
            kw[dst] = body[src]
    for src, dst in _EXTRAS.items():
        if body.get(src) is not None:
            kw[dst] = body[src]
    kw.setdefault("max_new_tokens", default_max_tokens)
    seed = body.get("seed")
    if isinstance(seed, Integral) and not isinstance(seed, bool) and not INT64[0] <= seed <= INT64[1]:
        raise APIError(f"seed: must fit in a signed 64-bit integer, got {seed}", param="seed")
    kw["logit_bias"] = logit_bias_of(body.get("logit_bias"))
    kw.update(constraint_from_openai(sglang_constraints(body)))  # response_format / regex / ebnf / json_schema
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise APIError("logprobs: must be a boolean (use top_logprobs for alternatives)", param="logprobs")
        kw["logprobs"] = bool(logprobs)
        if body.get("top_logprobs") not in (None, 0):  # 0: vLLM's default, sent by its clients without logprobs
            if not logprobs:
                raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
            kw["top_logprobs_num"] = body["top_logprobs"]
    elif logprobs is not None:
        if not isinstance(logprobs, Integral) or isinstance(logprobs, bool):
            raise APIError("logprobs: must be an integer (the number of alternatives per token)", param="logprobs")
        kw["logprobs"], kw["top_logprobs_num"] = True, logprobs
    names = user_names(body, chat)
    try:
        sp = SamplingParams(**kw).normalize()
        sp.verify(vocab_size)
    except (TypeError, ValueError) as e:
        raise renamed_error(e, names) from None
    return sp


def sglang_constraints(body: dict) -> dict:
    """The body with vLLM's constraint fields (guided_json/regex/grammar/choice, structured_outputs) under
    SGLang's names; guided_choice becomes a regex that matches exactly one of the choices."""
    vllm = {k: body[k] for k in _VLLM_CONSTRAINTS if body.get(k) is not None}
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - set(_STRUCTURED_OUTPUTS):
            raise APIError(f"structured_outputs: an object with one of {sorted(_STRUCTURED_OUTPUTS)}",
                           param="structured_outputs")
        vllm.update({_STRUCTURED_OUTPUTS[k]: v for k, v in outputs.items() if v is not None})
    if not vllm:
        return body
    if len(vllm) > 1:
        raise APIError(f"{sorted(vllm)[1]}: only one output constraint per request", param=sorted(vllm)[1])
    (name, value), = vllm.items()
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError("guided_choice: must be a non-empty list of non-empty strings", param="guided_choice")
        value = "|".join("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in value)
    target = _VLLM_CONSTRAINTS[name]
    if body.get(target) is not None:
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


def parse_chat_messages(messages: Any) -> tuple[list[dict], list[Any], list[Any], list[Any]]:
    """Returns (template messages, images, videos, audios) in prompt order.

    Template messages use the HF content-part form ({"type": "image"} etc.) that chat templates
    expect; the media values go to the multimodal loader untouched (URL, data URI, path, base64).
    An assistant message's tool_calls and a tool message's tool_call_id are kept for the template.
    """
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: must be a non-empty list", param="messages")
    out, images, videos, audios = [], [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
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
                    raise APIError(f"messages[{i}].tool_calls[{k}].function.arguments: not valid JSON",
                                   param="messages") from None
            rendered.append({"id": call.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": args}})
        extra["tool_calls"] = rendered
    for key in ("tool_call_id", "name"):
        if isinstance(msg.get(key), str):
            extra[key] = msg[key]
    return extra
