"""A tokenized request checked against the model and the server's limits before it is sent.

Every failure is a ValueError whose message starts with the field at fault (the HTTP layer renames it
to the field the user sent).
"""

from __future__ import annotations

from dataclasses import replace

from tessera.frontend.request import GenerateRequest
from tessera.messages.items import MultimodalInputs
from tessera.messages.pooling import PoolingParams
from tessera.models.config import ModelConfig


def check_lengths(req: GenerateRequest, input_ids: list[int], mm_inputs: MultimodalInputs | None,
                  config: ModelConfig, context_length: int, max_total_tokens: int) -> None:
    """The prompt and its max_new_tokens fit the context and the KV pool (an omitted max_tokens becomes what
    is left), and logprob_start_len falls inside the prompt."""
    sp = req.sampling_params
    if not input_ids:
        raise ValueError("prompt: empty prompt (no tokens)")
    if config.family.encoder_decoder and (mm_inputs is None or len(mm_inputs.items) != 1):
        raise ValueError(f"audio_data: {config.architecture} decodes one audio clip per request; give exactly "
                         "one")
    if req.logprob_start_len >= len(input_ids):
        raise ValueError(f"logprob_start_len: {req.logprob_start_len} is not inside the prompt of "
                         f"{len(input_ids)} tokens")
    # Per-request state (models/request_state.py: cross-attention K/V of the request's media) shares the pool.
    state = config.family.model_class().request_state
    cross = state.extra_slots(config, mm_inputs.items if mm_inputs is not None else []) if state is not None else 0
    if req.auto_max_new_tokens:
        sp.max_new_tokens = max(0, min(context_length, max_total_tokens - cross) - len(input_ids))
    if len(input_ids) > context_length or len(input_ids) == context_length and req.pooling is None:
        raise ValueError(f"prompt: {len(input_ids)} tokens does not fit the context length {context_length}")
    if len(input_ids) + sp.max_new_tokens > context_length:  # OpenAI and vLLM refuse; never cap silently
        raise ValueError(
            f"max_new_tokens: the context length is {context_length} tokens; the prompt has "
            f"{len(input_ids)} and {sp.max_new_tokens} more were asked for (at most "
            f"{context_length - len(input_ids)} fit)")
    if len(input_ids) + sp.max_new_tokens + cross > max_total_tokens:
        held = f" + cross-attention K/V ({cross})" if cross else ""
        raise ValueError(
            f"max_new_tokens: prompt ({len(input_ids)}) + max_new_tokens ({sp.max_new_tokens}){held} exceeds "
            f"the KV pool ({max_total_tokens} tokens; the server's --max-total-tokens)")


def check_pooling(pooling: PoolingParams | None, config: ModelConfig, is_embedding: bool = False
                  ) -> PoolingParams | None:
    """The request's pooling as it will run: an embedding request's settings fit the model (its family gives
    embeddings, `dimensions` is within the vector's size; a dual encoder pools by its own rule, so its pooler
    is "last"); a generation request is refused by an embedding server (--is-embedding, or an embedding-only
    model)."""
    family = config.family
    if pooling is None:
        if family.embedding_only:
            raise ValueError(f"prompt: {config.architecture} is an embedding model; ask /v1/embeddings "
                             "(Engine.encode)")
        if is_embedding:
            raise ValueError(f"prompt: {config.architecture} is served for embeddings only (--is-embedding, or a base "
                             "model without its LM head); ask /v1/embeddings (Engine.encode)")
        return None
    if family.encoder_decoder:
        raise ValueError(f"prompt: {config.architecture} is an encoder-decoder model and gives no embeddings")
    pooling.verify(config.embedding_size)
    return replace(pooling, method="last") if family.embedding_only else pooling
