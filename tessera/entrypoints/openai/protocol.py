"""Parsing of OpenAI request bodies into Tessera's types, with errors that name the field."""

from __future__ import annotations

from typing import Any

from tessera.entrypoints.openai.errors import APIError
from tessera.sampling_params import SamplingParams

# OpenAI name -> SamplingParams name; vLLM/SGLang extras pass through under their own names.
_OPENAI_TO_SP = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n": "n",
                 "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "stop_token_ids",
           "min_tokens")


def sampling_params_from_openai(body: dict, default_max_tokens: int) -> SamplingParams:
    kw: dict[str, Any] = {}
    for src, dst in _OPENAI_TO_SP.items():
        if body.get(src) is not None:
            kw[dst] = body[src]
    for name in _EXTRAS:
        if body.get(name) is not None:
            kw["min_new_tokens" if name == "min_tokens" else name] = body[name]
    kw.setdefault("max_new_tokens", default_max_tokens)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool):  # chat: logprobs bool + top_logprobs int
            kw["logprobs"] = logprobs
            if body.get("top_logprobs") is not None:
                if not logprobs:
                    raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
                kw["top_logprobs_num"] = body["top_logprobs"]
        elif isinstance(logprobs, int):  # completions: logprobs is the number of alternatives
            kw["logprobs"], kw["top_logprobs_num"] = True, logprobs
        else:
            raise APIError("logprobs must be a boolean (chat) or an integer (completions)", param="logprobs")
    try:
        sp = SamplingParams(**kw).normalize()
    except TypeError as e:
        raise APIError(str(e)) from None
    return sp


def _media_url(part: dict, key: str) -> str:
    val = part.get(key)
    if isinstance(val, dict):
        val = val.get("url")
    if not isinstance(val, str) or not val:
        raise APIError(f"messages: a {key} part needs a non-empty url", param=f"messages.content.{key}")
    return val


def parse_chat_messages(messages: Any) -> tuple[list[dict], list[Any], list[Any], list[Any]]:
    """Returns (template messages, images, videos, audios) in prompt order.

    Template messages use the HF content-part form ({"type": "image"} etc.) that chat templates
    expect; the media values go to the multimodal loader untouched (URL, data URI, path, base64).
    """
    if not isinstance(messages, list) or not messages:
        raise APIError("messages: must be a non-empty list", param="messages")
    out, images, videos, audios = [], [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise APIError(f"messages[{i}]: each message needs a role", param="messages")
        role = msg["role"]
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(f"messages[{i}].role: unknown role {role!r}", param="messages")
        role = "system" if role == "developer" else role
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(f"messages[{i}].content: must be a string or a list of parts", param="messages")
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise APIError(f"messages[{i}].content[{j}]: each part needs a type", param="messages")
            kind = part["type"]
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise APIError(f"messages[{i}].content[{j}].text: must be a string", param="messages")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                images.append(_media_url(part, "image_url"))
                parts.append({"type": "image"})
            elif kind == "video_url":
                videos.append(_media_url(part, "video_url"))
                parts.append({"type": "video"})
            elif kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise APIError(f"messages[{i}].content[{j}].input_audio: needs base64 data", param="messages")
                audios.append(audio["data"])
                parts.append({"type": "audio"})
            elif kind == "audio_url":
                audios.append(_media_url(part, "audio_url"))
                parts.append({"type": "audio"})
            else:
                raise APIError(f"messages[{i}].content[{j}].type: unsupported part type {kind!r}", param="messages")
        out.append({"role": role, "content": parts})
    return out, images, videos, audios
