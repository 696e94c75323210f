"""vLLM's /tokenize and /detokenize: the server's tokenizer (and chat template) over HTTP."""

from __future__ import annotations

from tessera.entrypoints.openai.chat import chat_prompt
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.protocol import parse_chat_messages
from tessera.entrypoints.openai.request_models import DetokenizeRequest, TokenizeRequest
from tessera.entrypoints.openai.serving import OpenAIServing


def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> dict:
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("prompt: give exactly one of prompt or messages", param="prompt")
    tm = serving.tm
    if req.messages is not None:
        messages, images, videos, audios = parse_chat_messages(req.messages)
        if images or videos or audios:  # their placeholders expand per item only when the media is processed
            raise APIError("messages: /tokenize counts text only; media parts are not expanded here",
                           param="messages")
        text = chat_prompt(serving, messages, req, None)
    else:
        text = req.prompt
    # A prompt gets the tokenizer's special tokens; a rendered chat template already has them.
    add_special = req.add_special_tokens if req.add_special_tokens is not None else req.messages is None
    ids = tm.tokenizer.encode(text, add_special_tokens=add_special)
    out = {"tokens": ids, "count": len(ids), "max_model_len": tm.context_length, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = tm.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    serving.check_model(req.model)
    vocab = serving.tm.info.vocab_size
    if not all(0 <= t < vocab for t in req.tokens):
        raise APIError(f"tokens: must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": serving.tm.tokenizer.decode(req.tokens)}
