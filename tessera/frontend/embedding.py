"""Embedding requests in the frontend: Engine.encode's and /v1/embeddings' inputs made into GenerateRequests
that carry PoolingParams (prefill only; the scheduler answers each with its pooled vector).

Text is tokenized with the tokenizer's special tokens (as SGLang's and vLLM's embedding paths do), token ids
are taken as given. A prompt with images but without the model's image placeholders is rendered through the
chat template as one user turn (the images, then the text), without a generation prompt: vLLM's `messages`
form of an embedding request (GME, VLM2Vec).
"""

from __future__ import annotations

from typing import Any

from tessera.frontend.request import GenerateRequest
from tessera.frontend.result import GenerateResult
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams


def embedding_request(pooling: PoolingParams, text: str | None = None, input_ids: list[int] | None = None,
                      image_data: list[Any] | None = None, add_special_tokens: bool = True,
                      rid: str | None = None, sampling: SamplingParams | None = None) -> GenerateRequest:
    """One embedding request (no tokens generated: max_new_tokens 0); an empty prompt fails when it is
    tokenized, unless images come with it. sampling: the batch's shared SamplingParams(max_new_tokens=0)
    (nothing changes an embedding request's after its check: one check and one pickled copy for the batch)."""
    extra = {"rid": rid} if rid is not None else {}
    if text is None and input_ids is None:
        text = ""  # an image alone (a dual encoder's image input)
    sampling = sampling if sampling is not None else SamplingParams(max_new_tokens=0)
    return GenerateRequest(text=text, input_ids=input_ids, sampling_params=sampling,
                           image_data=image_data or None, pooling=pooling, add_special_tokens=add_special_tokens,
                           **extra)


def media_prompt(info, mm_processor, text: str | None, num_images: int) -> str | None:
    """`text` as a prompt for `num_images` images: unchanged when it holds the model's placeholders (or there
    are no images), else one chat-templated user turn with the images before the text."""
    if not num_images or mm_processor is None or info.config.family.embedding_only:
        return text  # a text-only model refuses the images when it tokenizes; a dual encoder takes them bare
    if text is not None and mm_processor.has_placeholders(text):
        return text
    content = [{"type": "image"}] * num_images + ([{"type": "text", "text": text}] if text else [])
    return info.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=False)


def embedding_result(out: GenerateResult) -> dict:
    """Engine.encode's answer for one request: the vector as a list of floats and the prompt's token count."""
    return {"embedding": out.embedding.tolist(),
            "meta_info": {"id": out.rid, "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                          "e2e_latency": out.e2e_latency}}
