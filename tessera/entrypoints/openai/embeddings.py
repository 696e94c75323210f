"""/v1/embeddings: OpenAI's embeddings API over the pooling run mode (frontend/embedding.py).

`input` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's forms), or
SGLang's multimodal form, a list of {"text", "image"} objects; vLLM's chat form sends `messages` instead (image_url
parts), rendered through the chat template without a generation prompt. Each input is one embedding request;
the request's inputs are tokenized, sent and answered as one batch (frontend/embed_batch.py), and batched with
whatever else runs. `encoding_format` base64 is the float32 vector's little-endian bytes (what the openai client
asks for by default and decodes). Errors are 400s naming the field.
"""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from tessera.entrypoints.openai.chat import chat_prompt
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.protocol import parse_chat_messages
from tessera.entrypoints.openai.request_models import REQUEST_BODIES, _Body
from tessera.entrypoints.openai.serving import OpenAIServing, check_batch
from tessera.frontend.embedding import embedding_request, media_prompt
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams

Input = str | list[str] | list[int] | list[list[int]] | list[dict[str, Any]] | None


class EmbeddingRequest(_Body):
    """OpenAI's embeddings request, with vLLM's `messages` form and pooling fields and SGLang's image inputs."""

    model: str | None = Field(None, description="The served model's name (`--served-model-name`); optional.")
    input: Input = Field(None, description="A string, a list of strings, token ids, a list of token-id lists, or "
                                           "SGLang's [{text, image}] objects: one embedding each.")
    messages: list[dict[str, Any]] | None = Field(
        None, description="vLLM: chat messages (text and image_url parts) embedded as one chat-templated prompt.")
    encoding_format: Literal["float", "base64"] = Field("float", description="float lists, or base64 float32.")
    dimensions: int | None = Field(None, description="Keep the first N values (Matryoshka), then normalise.")
    user: str | None = Field(None, description="OpenAI's end-user id; accepted, changes nothing.")
    normalize: bool | None = Field(None, description="vLLM: L2-normalise the vector (default true).")
    add_special_tokens: bool | None = Field(
        None, description="vLLM: tokenize `input` text with the tokenizer's special tokens (default true; false "
                          "for `messages`, whose template has them).")
    add_generation_prompt: bool | None = Field(None, description="vLLM: `messages` end with a generation prompt.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")


# The body joins the table /openapi.json reads (declared here, beside its handler, so request_models.py need
# not import this module).
REQUEST_BODIES["/v1/embeddings"] = (EmbeddingRequest, "application/json")


def _inputs(req: EmbeddingRequest) -> tuple[list[tuple[str | None, list[int] | None, list[Any]]], str]:
    """(text, token ids, images) per embedding, and the field they came from."""
    if (req.input is None) == (req.messages is None):
        raise APIError("input: give exactly one of input or messages", param="input")
    if req.messages is not None:
        return [(None, None, [])], "messages"
    value = req.input
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise APIError("input: must be a non-empty string, list of strings or list of token ids", param="input")
    check_batch(len(value), "input")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            if not v:
                raise APIError(f"input[{i}]: empty string", param="input")
            out.append((v, None, []))
        elif isinstance(v, list) and v and all(_is_id(t) for t in v):
            out.append((None, v, []))
        elif isinstance(v, dict) and set(v) <= {"text", "image"} and v:
            text, image = v.get("text"), v.get("image")
            if text is not None and not isinstance(text, str) or image is not None and not isinstance(image, str):
                raise APIError(f"input[{i}]: text and image must be strings (an image URL, path or data URI)",
                               param="input")
            out.append((text, None, [image] if image else []))
        else:
            raise APIError(f"input[{i}]: expected a non-empty string, a list of token ids or a {{text, image}} "
                           f"object", param="input")
    return out, "input"


def _parts(content: Any) -> list[dict]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _pooling(serving: OpenAIServing, req: EmbeddingRequest) -> PoolingParams:
    return PoolingParams(serving.tm.args.pooling or "last", req.normalize is not False, req.dimensions)


def _encoded(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


async def create_embedding(serving: OpenAIServing, request: Request, req: EmbeddingRequest) -> dict:
    serving.check_model(req.model)
    items, field = _inputs(req)
    pooling = _pooling(serving, req)
    try:
        pooling.verify(serving.tm.info.config.embedding_size)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(":")[0]) from None
    tm = serving.tm
    reqs = []
    if field == "messages":
        messages, images, videos, audios = parse_chat_messages(req.messages)
        if videos or audios:
            raise APIError("messages: embeddings take text and image parts only", param="messages")
        if tm.info.config.family.embedding_only:  # a dual encoder has no chat template: its text parts as given
            text = " ".join(p["text"] for m in messages for p in _parts(m["content"]) if p.get("type") == "text")
        else:
            template = SimpleNamespace(continue_final_message=False, add_generation_prompt=bool(
                req.add_generation_prompt), chat_template_kwargs=req.chat_template_kwargs)
            text = chat_prompt(serving, messages, template, None)
        reqs.append(embedding_request(pooling, text, None, images, bool(req.add_special_tokens)))
    else:
        sampling = SamplingParams(max_new_tokens=0)  # shared by the batch (see embedding_request)
        for text, ids, images in items:
            if ids is None:
                text = media_prompt(tm.info, tm.mm_processor, text or "", len(images))
            reqs.append(embedding_request(pooling, text, ids, images, req.add_special_tokens is not False,
                                          sampling=sampling))
    names = {n: field for n in ("prompt", "input_ids", "media", "image_data")}
    tokenized = await serving.prepare(reqs, names, batched=True)
    outs = await serving.collect_all(request, reqs, tokenized, batched=True)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, req.encoding_format)}
            for i, out in enumerate(outs)]
    tokens = sum(out.prompt_tokens for out in outs)
    return {"object": "list", "data": data, "model": serving.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
