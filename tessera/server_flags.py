"""`tessera serve --help`: the group and the one-line description of every ServerArgs field.

Kept next to ServerArgs (config.py) but apart from it, so the dataclass stays readable; a test checks that
every field has an entry here, so a new flag cannot arrive without its help text.
"""

from __future__ import annotations

GROUPS = {
    "model": "Model: what to serve",
    "runtime": "Runtime: devices, precision, parallelism",
    "scheduling": "Scheduling and memory: batching, KV cache",
    "multimodal": "Multimodal: media loading, limits and safety",
    "server": "Server: HTTP, security, logging, metrics",
}

FLAGS: dict[str, tuple[str, str]] = {
    # model
    "model_path": ("model", "local Hugging Face checkpoint directory, or a bundled model: demo-vl, demo-asr "
                            "(never downloads)"),
    "tokenizer_path": ("model", "tokenizer/processor directory, if not the model's"),
    "served_model_name": ("model", "model name the API reports and accepts (default: the directory's name)"),
    "chat_template": ("model", "Jinja chat template (a file or the template text) replacing the checkpoint's"),
    "reasoning_parser": ("model", "split a thinking model's reasoning into reasoning_content (SGLang's names: "
                                  "qwen3, qwen3-thinking, deepseek-r1, deepseek-v3, glm45, kimi, step3, minimax, "
                                  "mistral)"),
    "tool_call_parser": ("model", "how tool calls are read from the model's text (SGLang's names: qwen25, hermes, "
                                  "llama3, llama4, pythonic, mistral, gemma, internlm, glm45; default: chosen "
                                  "from the chat template)"),
    "context_length": ("model", "longest prompt + output in tokens (default: the model's max_position_embeddings)"),
    "language_model_only": ("model", "skip the vision/audio encoders: text only, less memory"),
    "model_type": ("model", "auto (what config.json describes) or llm: serve the understanding (LLM) tower of a "
                            "multi-tower checkpoint, e.g. Cosmos3's Diffusers-layout world models (SGLang's flag)"),
    "model_impl": ("model", "auto (native where Tessera has the family, else the Transformers backend), native, or "
                            "transformers (the model's own transformers code with Tessera's paged attention)"),
    "is_embedding": ("model", "serve the model for embeddings (/v1/embeddings): the warm-up embeds instead of "
                              "generating; embedding architectures (CLIPModel) turn it on by themselves"),
    "pooling": ("model", "how embedding requests pool the final hidden states: last (the last token), mean, cls "
                         "(the first token) (default: last)"),
    # runtime
    "dtype": ("runtime", "weights and KV dtype: auto (the checkpoint's), float32, bfloat16, float16"),
    "torchao_config": ("runtime", "weight-only quantization of the language model at load: int8wo, int4wo-32, "
                                  "int4wo-64, int4wo-128 or int4wo-256 (default: the checkpoint's float weights)"),
    "device": ("runtime", "auto, cpu, cuda or cuda:N (auto picks CUDA when present)"),
    "attention_backend": ("runtime", "attention kernels: auto (on CUDA flashinfer when installed "
                                     "and the dtype is 16-bit, else triton; torch_native elsewhere), "
                                     "torch_native, triton or flashinfer"),
    "disable_cuda_graph": ("runtime", "run decode steps eagerly instead of replaying CUDA graphs"),
    "cuda_graph_max_bs": ("runtime", "largest decode batch captured as a CUDA graph (default: "
                                     "max_running_requests, at most 160)"),
    "enable_torch_compile": ("runtime", "capture the decode CUDA graphs over the model compiled by torch.compile "
                                        "(inductor); falls back to the eager kernels if compiling fails"),
    "torch_compile_max_bs": ("runtime", "largest decode batch whose graph is compiled (default 32)"),
    "tp_size": ("runtime", "tensor-parallel ranks (GPUs) per replica"),
    "dp_size": ("runtime", "data-parallel replicas (each a scheduler + model) behind one frontend"),
    "load_balance_method": ("runtime", "how requests pick a replica: round_robin, shortest_queue, cache_aware"),
    "mm_enable_dp_encoder": ("runtime", "under tensor parallelism, share each step's images out over the ranks"),
    "base_gpu_id": ("runtime", "first GPU this server uses"),
    "nnodes": ("runtime", "machines the tensor-parallel ranks are spread over"),
    "node_rank": ("runtime", "this machine's rank among --nnodes (0 runs the HTTP server)"),
    "dist_init_addr": ("runtime", "host:port of node 0's rendezvous (several nodes)"),
    "random_seed": ("runtime", "seed of the sampler and model init"),
    "cpu_threads": ("runtime", "intra-op threads of the model on CPU (default: adaptive)"),
    "disable_decode_kv_mirror": ("runtime", "decode reads K/V from the paged pool instead of a contiguous copy"),
    "enable_lora": ("model", "serve LoRA adapters (PEFT format) over the base model, mixed in one batch"),
    "lora_paths": ("model", "adapters loaded at start: name=path or a path (named after its directory); "
                            "implies --enable-lora"),
    "max_loras_per_batch": ("model", "adapter slots on the device: distinct adapters one batch mixes; more wait, "
                                     "the least recently used is evicted to the host"),
    "max_lora_rank": ("model", "refuse adapters of a higher rank (default: any rank)"),
    "lora_backend": ("model", "LoRA products: auto (Triton on CUDA, grouped torch products elsewhere), torch, "
                              "triton or csgmv (SGLang's name; runs the Triton kernel)"),
    # scheduling
    "max_running_requests": ("scheduling", "requests decoded together at most"),
    "chunked_prefill_size": ("scheduling", "prompt tokens prefilled per step at most (long prompts in chunks)"),
    "max_prefill_tokens": ("scheduling", "prompt tokens admitted per step at most"),
    "page_size": ("scheduling", "KV cache page size in tokens"),
    "max_total_tokens": ("scheduling", "KV pool size in tokens (default: CUDA: what --mem-fraction-static "
                                       "leaves after the weights; CPU: --max-running-requests x context, at most the "
                                       "weights' bytes, at least one full context)"),
    "mem_fraction_static": ("scheduling", "share of GPU memory for weights + KV pool"),
    "disable_radix_cache": ("scheduling", "no prefix reuse across requests"),
    "schedule_policy": ("scheduling", "queue order: fcfs or lpm (longest cached prefix first)"),
    "enable_overlap_schedule": ("scheduling", "form and launch the next decode step while the device runs the "
                                              "current one (off by default: not yet run on a GPU; one TP rank)"),
    "disable_overlap_schedule": ("scheduling", "SGLang's flag: no overlap scheduling (already Tessera's default)"),
    "stream_interval": ("scheduling", "tokens per streamed chunk"),
    "speculative_algorithm": ("scheduling", "speculative decoding: NGRAM (prompt lookup), STANDALONE (a draft "
                                            "model with the same tokenizer); EAGLE is not supported"),
    "speculative_draft_model_path": ("scheduling", "STANDALONE's draft checkpoint (a directory, or demo-vl-draft: "
                                                   "demo-vl's bundled one)"),
    "speculative_num_steps": ("scheduling", "draft tokens proposed per verify step (default: 4)"),
    "speculative_eagle_topk": ("scheduling", "drafts per position: 1 only (chains, no token trees)"),
    "speculative_num_draft_tokens": ("scheduling", "tokens scored per verify step, num_steps + 1 (default: 5)"),
    "speculative_ngram_min_match_window_size": ("scheduling", "NGRAM: shortest suffix matched"),
    "speculative_ngram_max_match_window_size": ("scheduling", "NGRAM: longest suffix matched (tried first)"),
    "speculative_ngram_min_bfs_breadth": ("scheduling", "accepted for SGLang's command lines; no effect (chains)"),
    "speculative_ngram_max_bfs_breadth": ("scheduling", "accepted for SGLang's command lines; no effect (chains)"),
    "speculative_ngram_match_type": ("scheduling", "accepted for SGLang's command lines; no effect (chains)"),
    "speculative_ngram_branch_length": ("scheduling", "accepted for SGLang's command lines; no effect (chains)"),
    "speculative_ngram_capacity": ("scheduling", "accepted for SGLang's command lines; no effect (a per-request "
                                                 "index)"),
    "speculative_disable_by_batch_size": ("scheduling", "no drafts once this many requests decode together"),
    "speculative_oracle_path": ("scheduling", "benchmarks only: ORACLE's recorded greedy answers (JSON)"),
    # multimodal
    "mm_cache_size_mb": ("multimodal", "encoder-output and preprocessing cache size in MiB"),
    "keep_mm_feature_on_device": ("multimodal", "keep preprocessed media features on the GPU"),
    "mm_process_config": ("multimodal", 'JSON per-modality processor settings, e.g. \'{"image": {"max_pixels": '
                                        '200704}}\''),
    "limit_mm_data_per_request": ("multimodal", 'JSON items per request per modality, e.g. \'{"image": 4}\' '
                                                '(default: image 16, video 4, audio 8)'),
    "allowed_local_media_path": ("multimodal", "directory whose files requests may name as media (default: no "
                                               "local files)"),
    "allow_private_media_urls": ("multimodal", "let media URLs reach loopback/private addresses (link-local and "
                                               "cloud metadata stay refused)"),
    "allowed_media_domains": ("multimodal", "host names media URLs may use, space- or comma-separated (*.example.com for "
                                            "subdomains; default: any public host)"),
    "max_image_pixels": ("multimodal", "refuse larger images before decoding (default: 67M pixels)"),
    "mm_preprocess_workers": ("multimodal", "processes that load and preprocess media (0: a thread pool in the "
                                            "frontend)"),
    "disable_deferred_mm_preprocessing": ("multimodal", "preprocess images fully in the frontend instead of "
                                                        "resizing/normalising them on the worker"),
    # server
    "host": ("server", "address to listen on"),
    "port": ("server", "port to listen on"),
    "max_request_body_mb": ("server", "largest request body in MiB (inline media included); larger: HTTP 413"),
    "api_key": ("server", "require 'Authorization: Bearer KEY' (not on /health and /metrics, as SGLang)"),
    "api_key_file": ("server", "read the API key from this file (the environment's TESSERA_API_KEY also works), "
                               "so it is not in the server's command line"),
    "max_queued_requests": ("server", "generations allowed to wait beyond the running slots (max_running_requests x "
                                      "dp_size); more get HTTP 503 with Retry-After (default: no limit)"),
    "skip_server_warmup": ("server", "start serving without the warm-up (four short generations, each with an image "
                                     "where the model takes images, that run the lazy first-call setup)"),
    "log_level": ("server", "debug, info, warning, error (debug also prints tracebacks of CLI errors)"),
    "enable_metrics": ("server", "serve Prometheus metrics at /metrics (false: /metrics answers 404)"),
    "disable_tqdm": ("server", "no progress bars (weight loading; Engine.generate batches)"),
}

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def parse_bool(text: str) -> bool:
    """The forms people type after a boolean flag: true/false, 1/0, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


parse_bool.__name__ = "boolean"  # argparse names the type in its error: "invalid boolean value: 'maybe'"
