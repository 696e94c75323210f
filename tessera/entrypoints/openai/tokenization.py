"""vLLM's /tokenize and /detokenize: the server's tokenizer (and chat template) over HTTP."""

from __future__ import annotations

from tessera.entrypoints.openai.chat import chat_prompt
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.protocol import parse_chat_messages
from tessera.entrypoints.openai.request_models import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from tessera.entrypoints.openai.serving import OpenAIServing


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(f"{name}: must be a boolean", param=name)
    return value


def tokenize(serving: OpenAIServing, body: dict) -> dict:
    serving.check_model(body)
    unknown = sorted(set(body) - TOKENIZE_FIELDS)
    if unknown:
        raise APIError(f"{unknown[0]}: unknown parameter", param=unknown[0])
    if ("prompt" in body) == ("messages" in body):
        raise APIError("prompt: give exactly one of prompt or messages", param="prompt")
    tm = serving.tm
    if "messages" in body:
        messages, images, videos, audios = parse_chat_messages(body["messages"])
        if images or videos or audios:  # their placeholders expand per item only when the media is processed
            raise APIError("messages: /tokenize counts text only; media parts are not expanded here",
                           param="messages")
        text = chat_prompt(serving, messages, body, None)
        add_special = _bool(body, "add_special_tokens", False)  # the template already has them
    else:
        text = body["prompt"]
        if not isinstance(text, str):
            raise APIError("prompt: must be a string", param="prompt")
        add_special = _bool(body, "add_special_tokens", True)
    ids = tm.tokenizer.encode(text, add_special_tokens=add_special)
    out = {"tokens": ids, "count": len(ids), "max_model_len": tm.context_length, "token_strs": None}
    if _bool(body, "return_token_strs", False):
        out["token_strs"] = tm.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(serving: OpenAIServing, body: dict) -> dict:
    serving.check_model(body)
    unknown = sorted(set(body) - DETOKENIZE_FIELDS)
    if unknown:
        raise APIError(f"{unknown[0]}: unknown parameter", param=unknown[0])
    ids = body.get("tokens")
    vocab = serving.tm.info.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
        raise APIError(f"tokens: must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": serving.tm.tokenizer.decode(ids)}
