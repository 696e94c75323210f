"""Request fields that SGLang and vLLM declare and Tessera does not act on: accepted at their no-op values,
refused (400 naming the field, with the reason below) at any other.

Clients written for a peer send its fields even when they mean nothing: SGLang's benchmark client sends
`"return_routed_experts": false` to /generate, its `--cache-report` sends
`return_cached_tokens_details`. A field that is neither honoured nor listed here stays an unknown field (400).
tests/server/test_peer_fields.py checks every field of the peers' request models (pinned in
tests/fixtures/peer_request_fields.json) against the endpoints' accepted fields and these tables, and sends each
at its peer's default value.

Each entry: name -> (the values accepted as a no-op, why any other value is refused). None is always accepted.
"""

from __future__ import annotations

from typing import Any

_NO_LORA = "name the LoRA adapter with lora_path"
_NO_DISAGG = "prefill/decode disaggregation is not supported"
_NO_DP_ROUTE = "a request cannot pick its data-parallel replica (--load-balance-method decides)"
_NO_REASONING = ("thinking is the model's own: --reasoning-parser splits it out, chat_template_kwargs "
                 "{\"enable_thinking\": false} turns it off where the template does")
_NO_HIDDEN = "hidden states, routed experts and indexer top-k are not returned"
_NO_SESSION = "sessions (continued prompts kept by the server) are not supported; the radix cache reuses prefixes"
_NO_CUSTOM = "custom logit processors and parameters are not supported"
_NO_TOKENS_OUT = "token ids and offsets are returned through logprobs only"
_NO_PRIORITY = "requests are scheduled first come, first served (no priorities)"

# Fields of both OpenAI endpoints (chat and completions), from OpenAI's, SGLang's and vLLM's request models.
OPENAI_NOOPS: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI's own, sent by its SDK and the libraries over it (metadata, prompt_cache_key and safety_identifier
    # take any value: request_models declares them).
    "store": ((False,), "chat completions are not stored (no GET /v1/chat/completions/{id}); /v1/responses "
                        "stores its responses"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "verbosity": (("medium",), "the answer's length follows the prompt and max_tokens; no verbosity control"),
    "modalities": ((["text"],), "the answer is text only (no audio output)"),
    "prediction": ((), "predicted outputs are not supported"),
    "audio": ((), "the answer is text only (no audio output)"),
    # SGLang
    "return_hidden_states": ((False,), _NO_HIDDEN),
    "return_routed_experts": ((False,), _NO_HIDDEN),
    "routed_experts_start_len": ((0,), _NO_HIDDEN),
    # usage.prompt_tokens_details.cached_tokens is always reported; there is no finer breakdown (device, host)
    "return_cached_tokens_details": ((False, True), "always reported as usage.prompt_tokens_details"),
    "return_prompt_token_ids": ((False,), _NO_TOKENS_OUT),
    "return_token_ids": ((False,), _NO_TOKENS_OUT),
    "return_meta_info": ((False,), "SGLang's meta_info is returned by /generate only"),
    "reasoning_effort": ((), _NO_REASONING),
    "separate_reasoning": ((True, False), "honoured by the chat endpoint: false returns the text as it is"),
    "stream_reasoning": ((True, False), _NO_REASONING),
    "task": ((), "the task is the endpoint's"),
    "stop_regex": ((), "stop strings are literal; regex stops are not supported"),
    "session_id": ((), _NO_SESSION),
    "session_params": ((), _NO_SESSION),
    "max_dynamic_patch": ((), "image tiling is the processor's configuration"),
    "min_dynamic_patch": ((), "image tiling is the processor's configuration"),
    "use_audio_in_video": ((False,), "a video's audio track is not used"),
    "images_config": ((), "image processing is the processor's configuration"),
    "custom_logit_processor": ((), _NO_CUSTOM),
    "custom_params": ((), _NO_CUSTOM),
    "input_ids": ((), "send a prompt of token ids to /v1/completions or /generate"),
    "rid": ((), "the request id is the x-request-id header"),
    "extra_key": ((), "use cache_salt to separate cached prefixes"),
    "ngram_corpus_id": ((), "NGRAM drafts come from each request's own tokens (no shared corpus)"),
    "priority": ((0,), _NO_PRIORITY),
    "bootstrap_host": ((), _NO_DISAGG),
    "bootstrap_port": ((), _NO_DISAGG),
    "bootstrap_room": ((), _NO_DISAGG),
    "routed_dp_rank": ((), _NO_DP_ROUTE),
    "data_parallel_rank": ((), _NO_DP_ROUTE),
    "disagg_prefill_dp_rank": ((), _NO_DISAGG),
    "custom_labels": ((), "metrics carry no per-request labels"),
    # vLLM
    "thinking_token_budget": ((), _NO_REASONING),
    "include_reasoning": ((True, False), _NO_REASONING),
    "watermarking": ((), "watermarking is not supported"),
    "length_penalty": ((1.0,), "a length penalty applies to beam search, which is not supported"),
    "truncate_prompt_tokens": ((), "prompts are never truncated: one too long is refused"),
    "truncation_side": ((), "prompts are never truncated: one too long is refused"),
    "logprob_token_ids": ((), "logprobs of chosen token ids are not supported; use top_logprobs"),
    "allowed_token_ids": ((), "use a regex or a JSON schema to constrain the output"),
    "bad_words": (([],), "use a regex or a JSON schema to constrain the output"),
    "add_special_tokens": ((False,), "special tokens are the chat template's (chat) or the prompt's own (completions)"),
    "documents": ((), "documents are not passed to the chat template"),
    "chat_template": ((), "the chat template is the server's (--chat-template)"),
    "mm_processor_kwargs": ((), "the processor's settings are the server's"),
    "request_id": ((), "the request id is the x-request-id header"),
    "return_tokens_as_token_ids": ((False,), _NO_TOKENS_OUT),
    "routed_experts_prompt_start": ((0,), _NO_HIDDEN),
    "return_token_offsets": ((False,), _NO_TOKENS_OUT),
    "return_prompt_text": ((False,), _NO_TOKENS_OUT),
    "return_mm_kwargs": ((True, False), "the processor's outputs are not returned"),
    "kv_transfer_params": ((), _NO_DISAGG),
    "ec_transfer_params": ((), _NO_DISAGG),
    "vllm_xargs": ((), "vLLM's extension arguments have no meaning here"),
    "repetition_detection": ((), "repetition detection is not supported; use repetition_penalty"),
    "stream_interval": ((), "the stream interval is the server's (--stream-interval)"),
    "prompt_embeds": ((), "prompt embeddings are not accepted"),
    "embed_dtype": (("float32",), "embeddings are float32"),
    # Declared with their types in request_models._Sampling (vLLM's and OpenAI's legacy fields).
    "guided_decoding_backend": ((), "the constrained-decoding backend is fixed (llguidance)"),
    "guided_whitespace_pattern": ((), "JSON output is compact; a whitespace pattern is not supported"),
    "structural_tag": ((), "structural tags are not supported; use response_format, regex, ebnf or json_schema"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "functions": ((), "the legacy functions API is not supported; use tools"),
    "function_call": ((), "the legacy functions API is not supported; use tool_choice"),
}

# SGLang's /generate (GenerateReqInput) beyond the fields it honours.
GENERATE_NOOPS: dict[str, tuple[tuple[Any, ...], str]] = {
    **{k: OPENAI_NOOPS[k] for k in (
        "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_prompt_token_ids",
        "use_audio_in_video", "session_id", "session_params", "custom_logit_processor",
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "data_parallel_rank",
        "disagg_prefill_dp_rank", "extra_key", "priority", "custom_labels", "max_dynamic_patch",
        "min_dynamic_patch", "images_config")},
    "input_embeds": ((), "input embeddings are not accepted"),
    "mm_hashes": ((), "media are hashed by their content, here"),
    "mm_content_hashes": ((), "media are hashed by their content, here"),
    "video_config": ((), "video sampling is the processor's configuration"),
    "token_ids_logprob": ((), "logprobs of chosen token ids are not supported; use top_logprobs_num"),
    "return_sampling_mask": ((False,), "the sampling mask is not returned"),
    "return_flat_raw_top_logprobs": ((False,), "top logprobs come as SGLang's nested lists"),
    "return_flat_raw_top_logprobs_b64": ((False,), "top logprobs come as SGLang's nested lists"),
    "log_metrics": ((True,), "every request is counted in /metrics"),
    "return_indexer_topk": ((False,), _NO_HIDDEN),
    "lora_id": ((), _NO_LORA),
    "positional_embed_overrides": ((), "input embeddings are not accepted"),
    "bootstrap_pair_key": ((), _NO_DISAGG),
    "decode_tp_size": ((), _NO_DISAGG),
    "kv_router_hint": ((), _NO_DISAGG),
    "routing_key": ((), _NO_DP_ROUTE),
    "conversation_id": ((), "conversations are not tracked"),
    "http_worker_ipc": ((), "an internal field of SGLang's"),
    "background": ((False,), "background (Responses API) requests are not supported"),
    "require_reasoning": ((False,), _NO_REASONING),
    "max_thinking_tokens": ((), _NO_REASONING),
    "no_logs": ((False,), "every request is logged (one access-log line)"),
    "return_bytes": ((False,), "an internal field of SGLang's"),
    "return_entropy": ((False,), "entropy is not returned"),
    "external_trace_header": ((), "tracing is not supported"),
    "received_time": ((), "an internal field of SGLang's"),
    "need_wait_for_mm_inputs": ((), _NO_DISAGG),
    "num_items_assigned": ((), _NO_DISAGG),
    "encoder_urls": ((), _NO_DISAGG),
    "image_max_dynamic_patch": ((), "image tiling is the processor's configuration"),
    "video_max_dynamic_patch": ((), "image tiling is the processor's configuration"),
    "multi_item_delimiter_indices": ((), "multi-item scoring is not supported"),
}


def refusal(name: str, value: Any, table: dict[str, tuple[tuple[Any, ...], str]]) -> str | None:
    """Why `name`: `value` is refused, or None when it is accepted as a no-op (None: always)."""
    noops, why = table[name]
    if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noops):
        return None
    return why
