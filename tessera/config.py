"""ServerArgs: the one configuration object, shared by the offline Engine and the server.

Validated once at construction; everything downstream reads it, nobody mutates it.
Argument names follow SGLang where SGLang has the same knob.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
BUNDLED_MODELS = ("demo-vl", "demo-asr", "demo-vl-draft")  # demo-vl-draft: demo-vl's STANDALONE draft
# Media items one request may carry when --limit-mm-data-per-request does not say (vLLM has such a default
# too): a message with 50 images is refused up front instead of tying up the preprocessing pool.
DEFAULT_MM_ITEMS_PER_REQUEST = {"image": 16, "video": 4, "audio": 8}
# --torchao-config (SGLang's names): weight-only int8 per channel, or int4 in groups of 32..256 columns.
TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")
# LoRA adapters shipped with the package (tessera/assets/lora/<name>): `--lora-paths demo-vl-unsure` names one.
BUNDLED_LORA_DIR = ASSETS_DIR / "lora"


MODEL_TYPES = ("auto", "llm")  # --model-type
MODEL_IMPLS = ("auto", "native", "transformers")  # --model-impl (models/transformers_family.py)


def resolve_model_path(name_or_path: str) -> str:
    """`demo-vl` / `demo-asr` / `demo-vl-draft` name the bundled checkpoints; anything else is a local directory."""
    if name_or_path in BUNDLED_MODELS:
        path = ASSETS_DIR / name_or_path
        if not (path / "config.json").exists():
            raise ValueError(f"model_path: bundled model {name_or_path!r} is not installed at {path}")
        return str(path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir() or not (path / "config.json").exists():
        raise ValueError(
            f"model_path: {name_or_path!r} is not a local Hugging Face checkpoint directory "
            f"(no config.json); Tessera never downloads weights. Bundled models: {', '.join(BUNDLED_MODELS)}"
        )
    return str(path.resolve())


def _json_dict(name: str, value: Any) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_device(device: str) -> None:
    """A device that is absent is a one-line error here, before anything starts."""
    if device == "auto" or device == "cpu":  # nothing to check, and no torch import for them
        return
    from tessera.platform.device import resolve_device

    resolve_device(device)


SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "ORACLE")
DEFAULT_SPECULATIVE_DRAFTS = 4


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = "demo-vl"
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    reasoning_parser: str | None = None  # SGLang's names (entrypoints/openai/reasoning.py)
    tool_call_parser: str | None = None  # SGLang's names (entrypoints/openai/tool_parsers.py); None: the template's
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    api_key_file: str | None = None  # the key in a file (or TESSERA_API_KEY): not on the command line
    max_queued_requests: int | None = None  # generations waiting beyond the running slots; more: HTTP 503
    # The HTTP server's warm-up requests through the whole path before it says it is ready (SGLang's flag).
    skip_server_warmup: bool = False
    # Model / runtime
    # "auto": the checkpoint's dtype (float32 when it records none; float16 becomes bfloat16 on CPU).
    dtype: str = "auto"
    # Weight-only quantization of the language model's linears at load (layers/quantization/int_linear.py);
    # "" keeps the checkpoint's float weights. One of TORCHAO_CONFIGS.
    torchao_config: str = ""
    device: str = "auto"  # auto | cpu | cuda[:N]; auto picks CUDA when available
    tp_size: int = 1
    # Under tensor parallelism, share each step's images out over the ranks (largest first to the least
    # loaded rank), each encoding its share with its full copy of the tower; one all_gather collects them.
    mm_enable_dp_encoder: bool = False
    dp_size: int = 1  # independent scheduler + worker replicas behind the one frontend
    load_balance_method: str = "round_robin"  # round_robin | shortest_queue | cache_aware (see frontend/dispatcher)
    base_gpu_id: int = 0  # first GPU of this server; replica r, TP rank t uses base + r * tp_size + t
    # Several nodes (SGLang's flags): the TP ranks are spread evenly over nnodes machines; node 0 runs the
    # frontend and the scheduler, node k > 0 only its ranks. Every node gets the same --dist-init-addr.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous
    random_seed: int = 0
    context_length: int | None = None
    # auto: on CUDA flashinfer (float16/bfloat16, when installed) or triton, both with CUDA graphs for decode;
    # torch_native elsewhere (layers/attention/__init__.py: resolve_attention_backend).
    attention_backend: str = "auto"
    # Decode steps replay CUDA graphs captured per batch-size bucket up to cuda_graph_max_bs (None: up to
    # max_running_requests, at most 160); larger batches, prefill chunks and steps with media run eagerly.
    # Only on CUDA with a backend that supports it (triton) and one TP rank.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # SGLang's --enable-torch-compile: the decode graphs of batches up to torch_compile_max_bs capture the model's
    # forward as torch.compile (inductor) built it instead of its eager kernels (worker/cuda_graph.py).
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # Decode reads each request's K/V from a contiguous copy kept across steps (appending one token per
    # step) instead of gathering it from the pool's pages every step; it costs up to the pool's size again.
    disable_decode_kv_mirror: bool = False
    language_model_only: bool = False
    # SGLang's --model-type: which of a checkpoint's runtimes to serve. auto: what config.json describes; llm: the
    # understanding (LLM/VLM) tower of a multi-tower checkpoint, e.g. Cosmos3's Diffusers-layout world models, which
    # SGLang otherwise routes to its diffusion runtime (their model_index.json). Tessera has no diffusion runtime, so
    # auto refuses such a checkpoint by name; the tower's weights are the root's, else the pipeline's `transformer/`.
    model_type: str = "auto"
    # SGLang's and vLLM's --model-impl: native (our model files), transformers (the model's transformers code with
    # our paged attention: models/transformers_backend.py), auto (native where the family table has the
    # architecture, otherwise the Transformers backend).
    model_impl: str = "auto"
    # Intra-op threads of the scheduler process (the model). None: on a CPU with one model rank, adaptive
    # (platform/threads.py: before each step, the cores that nothing else used in the last quarter
    # second, at least one); with several ranks, all cores but one split between them. A fixed count
    # loses either way on few cores: both of 2 cores ran demo-vl ~5x slower while anything else ran, one
    # of 2 leaves half the machine idle while the frontend is.
    cpu_threads: int | None = None
    # Scheduling and memory
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    page_size: int = 1
    # KV pool size in tokens. None: on CUDA, what --mem-fraction-static of the device leaves after the weights;
    # on CPU, max_running_requests x context length, capped at the weights' bytes (worker/model_worker.py).
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85  # share of the GPU's memory for weights + KV pool
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    # Overlap scheduling (scheduler/overlap.py): the host forms and launches decode step N+1 before it reads step
    # N's tokens. SGLang's --disable-overlap-schedule is accepted too; `overlap_schedule` decides.
    enable_overlap_schedule: bool = False
    disable_overlap_schedule: bool = False
    # Multimodal
    mm_cache_size_mb: int = 256
    keep_mm_feature_on_device: bool = False
    mm_process_config: dict = field(default_factory=dict)
    limit_mm_data_per_request: dict = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    allow_private_media_urls: bool = False  # fetch from loopback/private addresses (off: SSRF protection)
    # Comma-separated host names media URLs may name (each redirect hop too); `*.example.com` admits its
    # subdomains. None: any public host.
    allowed_media_domains: tuple[str, ...] | None = None
    max_image_pixels: int | None = None  # refuse larger images before decoding (None: the loader's default)
    # Largest HTTP request body read (inline base64 media included); larger ones are a 413 before they are
    # buffered, so one client cannot fill the frontend's memory.
    max_request_body_mb: int = 1024
    # Images go to the worker as uint8 pixels and are resized/normalised/patchified there, right before the
    # vision encoder (on its device), when that is smaller than the processed features; this turns it off.
    disable_deferred_mm_preprocessing: bool = False
    # Processes that load and preprocess media (decode, eager resize) off the frontend's GIL; requests are
    # routed by their media so each process's preprocessing cache sees its repeats. 0: a thread pool in the
    # frontend process.
    mm_preprocess_workers: int = 0
    # Frontend
    stream_interval: int = 1
    disable_tqdm: bool = False
    log_level: str = "info"
    enable_metrics: bool = True
    # Speculative decoding (SGLang's flags; scheduler/speculative.py): NGRAM (prompt lookup), STANDALONE (a small
    # draft checkpoint with the same tokenizer), ORACLE (benchmarks only: proposes a recorded greedy answer).
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None  # draft tokens proposed per verify step (k)
    speculative_eagle_topk: int | None = None  # 1 only: chain drafts (no token trees)
    speculative_num_draft_tokens: int | None = None  # tokens scored per verify step: k + 1
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # SGLang's n-gram tree knobs, accepted so its command lines start; Tessera's drafts are one chain.
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 10_000_000
    # No drafts once this many requests decode together (vLLM's speculative_disable_by_batch_size): a verify
    # step's k + 1 rows per request are free while a step reads weights, not once it computes.
    speculative_disable_by_batch_size: int = 4
    speculative_oracle_path: str | None = None  # ORACLE's recorded answers (a JSON file of prompt/output ids)
    # LoRA adapters (SGLang's flags): `name=path` or a path (named after its directory); layers/lora/.
    enable_lora: bool = False
    lora_paths: tuple[str, ...] | None = None
    max_loras_per_batch: int = 8  # adapter slots on the device: distinct adapters one batch can mix
    max_lora_rank: int | None = None  # refuse adapters of a higher rank (default: any)
    lora_backend: str = "auto"  # auto | torch | triton | csgmv (csgmv: SGLang's name; our Triton kernel)
    # Embeddings (frontend/embedding.py): --is-embedding serves the model as an embedding model (SGLang's flag;
    # chosen by itself for embedding architectures), --pooling the pooler embedding requests default to.
    is_embedding: bool = False
    pooling: str | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 — frozen dataclass normalisation
        set_("model_path", resolve_model_path(self.model_path))
        set_("mm_process_config", _json_dict("mm_process_config", self.mm_process_config))
        set_("limit_mm_data_per_request", _json_dict("limit_mm_data_per_request", self.limit_mm_data_per_request))
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = [domains]
        if domains is not None:
            domains = [d for entry in domains for d in str(entry).split(",")]
        if domains is not None:
            set_("allowed_media_domains", tuple(d.strip().lower() for d in domains if d.strip()))
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: expected {' or '.join(MODEL_TYPES)}, got {self.model_type!r}"
                             + (" (Tessera has no diffusion runtime)" if self.model_type == "diffusion" else ""))
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: expected one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.model_type != "llm" and (Path(self.model_path) / "model_index.json").exists():
            raise ValueError(f"model_type: {self.model_path} is a Diffusers pipeline (model_index.json); Tessera "
                             "serves its understanding (LLM) tower with --model-type llm (no image or video generation)")
        for key in self.mm_process_config:
            if key not in ("image", "video", "audio"):
                raise ValueError(f"mm_process_config: unknown modality {key!r} (expected image, video, audio)")
        for key, val in self.limit_mm_data_per_request.items():
            if key not in ("image", "video", "audio") or not isinstance(val, int) or val < 0:
                raise ValueError(f"limit_mm_data_per_request: bad entry {key!r}: {val!r}")
        positive = ("max_request_body_mb", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "page_size",
                    "stream_interval")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.max_queued_requests is not None and (not isinstance(self.max_queued_requests, int)
                                                     or self.max_queued_requests < 0):
            raise ValueError(f"max_queued_requests: must be an integer >= 0, got {self.max_queued_requests!r}")
        if self.max_total_tokens is not None and (not isinstance(self.max_total_tokens, int)
                                                  or self.max_total_tokens < 2 * self.page_size):
            raise ValueError(f"max_total_tokens: must hold at least two pages, got {self.max_total_tokens!r}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static!r}")
        _check_device(self.device)
        if not isinstance(self.torch_compile_max_bs, int) or self.torch_compile_max_bs < 1:
            raise ValueError(f"torch_compile_max_bs: must be a positive integer, got {self.torch_compile_max_bs!r}")
        if self.cuda_graph_max_bs is not None and (not isinstance(self.cuda_graph_max_bs, int)
                                                   or self.cuda_graph_max_bs < 1):
            raise ValueError(f"cuda_graph_max_bs: must be a positive integer, got {self.cuda_graph_max_bs!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads: must be a positive integer, got {self.cpu_threads!r}")
        for name in ("tp_size", "dp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in 0..nnodes-1, got {self.node_rank} of {self.nnodes}")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ValueError(f"tp_size: {self.tp_size} ranks do not spread evenly over nnodes={self.nnodes}")
            if self.dp_size != 1:
                raise ValueError("dp_size: several nodes serve one tensor-parallel replica; use --dp-size 1")
            if not self.dist_init_addr or ":" not in self.dist_init_addr:
                raise ValueError("dist_init_addr: several nodes need host:port of node 0's rendezvous")
        if self.load_balance_method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"load_balance_method: expected round_robin, shortest_queue or cache_aware, "
                             f"got {self.load_balance_method!r}")
        if not isinstance(self.mm_preprocess_workers, int) or self.mm_preprocess_workers < 0:
            raise ValueError(f"mm_preprocess_workers: must be >= 0, got {self.mm_preprocess_workers!r}")
        if self.mm_cache_size_mb < 0:
            raise ValueError(f"mm_cache_size_mb: must be >= 0, got {self.mm_cache_size_mb}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype: expected float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.torchao_config and self.torchao_config not in TORCHAO_CONFIGS:
            raise ValueError(f"torchao_config: expected one of {', '.join(TORCHAO_CONFIGS)} (or empty for float "
                             f"weights), got {self.torchao_config!r}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy: expected fcfs or lpm, got {self.schedule_policy!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level: unknown level {self.log_level!r}")
        if self.pooling is not None and self.pooling not in ("last", "mean", "cls"):
            raise ValueError(f"pooling: expected last, mean or cls, got {self.pooling!r}")
        if not (0 < self.port < 65536):
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        if self.speculative_algorithm is not None:
            set_("speculative_algorithm", self.speculative_algorithm.upper())
            self.speculative_num_draft  # noqa: B018 -- checks the speculative flags
        self._check_lora(set_)
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("enable_overlap_schedule: --disable-overlap-schedule is given too; choose one")

    @property
    def overlap_schedule(self) -> bool:
        """The one place the default is decided: off unless --enable-overlap-schedule (SGLang's default is on;
        ours stays off until the overlap has run on a GPU). Under tensor parallelism it stays off: only rank 0
        samples, so the other ranks could not resolve a step's input ids from the previous step's tokens."""
        return self.enable_overlap_schedule and not self.disable_overlap_schedule and self.tp_size == 1

    @property
    def speculative_num_draft(self) -> int:
        """Draft tokens per verify step (k), from SGLang's --speculative-num-steps / --speculative-num-draft-tokens
        (a chain of k drafts scores k + 1 tokens); 0 without speculation. Raises on flags that disagree."""
        algo = self.speculative_algorithm
        if algo is None:
            return 0
        if algo in ("EAGLE", "EAGLE3"):
            raise ValueError(f"speculative_algorithm: {algo} draft heads are not supported; use NGRAM or STANDALONE")
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm: expected one of {', '.join(SPECULATIVE_ALGORITHMS)}, got {algo!r}")
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError("speculative_eagle_topk: only 1 (a chain of drafts; token trees are not supported)")
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and tokens is not None and tokens != steps + 1:
            raise ValueError(f"speculative_num_draft_tokens: a chain of {steps} steps scores {steps + 1} tokens, "
                             f"got {tokens}")
        k = steps if steps is not None else (tokens - 1 if tokens is not None else DEFAULT_SPECULATIVE_DRAFTS)
        if not 1 <= k <= 16:
            raise ValueError(f"speculative_num_steps: 1..16 draft tokens per step, got {k}")
        if algo == "STANDALONE" and not self.speculative_draft_model_path:
            raise ValueError("speculative_draft_model_path: STANDALONE needs the draft checkpoint")
        if algo == "STANDALONE" and self.tp_size > 1:
            raise ValueError("speculative_algorithm: STANDALONE runs its draft on one device; with --tp-size > 1 "
                             "use NGRAM")
        if algo == "ORACLE" and not self.speculative_oracle_path:
            raise ValueError("speculative_oracle_path: ORACLE (a benchmark's) needs the recorded answers")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_ngram_min_match_window_size: need 1 <= min <= max, got {lo} and {hi}")
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError("speculative_disable_by_batch_size: must be >= 1")
        return k

    def _check_lora(self, set_) -> None:
        paths = self.lora_paths
        if isinstance(paths, dict):  # Engine(lora_paths={"name": "path"})
            paths = [f"{k}={v}" for k, v in paths.items()]
        elif isinstance(paths, str):
            paths = [paths]
        if paths is not None:
            set_("lora_paths", tuple(str(p) for p in paths))
            set_("enable_lora", True)  # naming adapters turns LoRA on, as in SGLang
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_paths: adapter names must be unique, got {names}")
        if not isinstance(self.max_loras_per_batch, int) or self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch: must be a positive integer, got {self.max_loras_per_batch!r}")
        if self.max_lora_rank is not None and (not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1):
            raise ValueError(f"max_lora_rank: must be a positive integer, got {self.max_lora_rank!r}")
        if self.lora_backend not in ("auto", "torch", "triton", "csgmv"):
            raise ValueError(f"lora_backend: expected auto, torch, triton or csgmv, got {self.lora_backend!r}")

    @property
    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-paths entry: `name=path`, or a path named after its last directory; a path
        that is no directory but a bundled adapter's name (tessera/assets/lora/) is that adapter."""
        out = []
        for entry in self.lora_paths or ():
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = Path(entry.rstrip("/")).name, entry
            if not Path(path).is_dir() and (BUNDLED_LORA_DIR / path).is_dir():
                path = str(BUNDLED_LORA_DIR / path)
            out.append((name, path))
        return out

    @property
    def mm_items_per_request(self) -> dict[str, int]:
        """The per-request item limits in force: --limit-mm-data-per-request over the defaults."""
        return {**DEFAULT_MM_ITEMS_PER_REQUEST, **self.limit_mm_data_per_request}

    @property
    def scheduler_threads(self) -> int:
        return self.cpu_threads or max(1, (os.cpu_count() or 1) - 1)

    @property
    def adaptive_threads(self) -> bool:
        """The scheduler process picks its thread count per step (cpu_threads unset, one model rank)."""
        return self.cpu_threads is None and self.tp_size * self.dp_size == 1

    @property
    def worker_threads(self) -> int:
        """Intra-op threads of each model rank: the scheduler's share split between all ranks of all replicas."""
        return max(1, self.scheduler_threads // (self.tp_size * self.dp_size))

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    # ---- command line -------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Every field as a flag, in the groups of `tessera serve --help`. Boolean flags take SGLang's bare form
        (`--enable-metrics`), an explicit value (`--enable-metrics false`, `=0`, `=no`) or `--no-...`."""
        from tessera.server_flags import FLAGS, GROUPS, parse_bool

        groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            group_key, text = FLAGS.get(f.name, ("server", ""))
            group = groups[group_key]
            if f.type in ("dict",) or default in (None, "") or "default:" in text:
                help_text = text
            else:
                shown = str(default).lower() if isinstance(default, bool) else default
                help_text = f"{text} (default: {shown})"
            help_text = help_text.replace("%", "%%")
            if f.type in ("bool",):
                group.add_argument(flag, type=parse_bool, nargs="?", const=True, default=default,
                                   metavar="BOOL", help=help_text)
                group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
            elif f.type in ("int", "int | None"):
                group.add_argument(flag, type=int, default=default, metavar="N", help=help_text)
            elif f.type in ("float", "float | None"):
                group.add_argument(flag, type=float, default=default, metavar="X", help=help_text)
            elif f.type in ("dict",):
                group.add_argument(flag, type=str, default=None, metavar="JSON", help=help_text)
            elif f.type.startswith("tuple"):  # vLLM's form (`--allowed-media-domains a.com b.org`) or a,b
                group.add_argument(flag, nargs="+", default=default, metavar="NAME", help=help_text)
            else:
                group.add_argument(flag, type=str, default=default, help=help_text)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        kwargs = {}
        for f in dataclasses.fields(cls):
            val = getattr(ns, f.name, None)
            if val is not None:
                kwargs[f.name] = val
        return cls(**kwargs)

    @classmethod
    def for_engine(cls, model_path: str, **kwargs: Any) -> ServerArgs:
        """The offline Engine trusts its caller with local files unless told otherwise."""
        kwargs.setdefault("allowed_local_media_path", "/")
        kwargs.setdefault("allow_private_media_urls", True)
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Engine argument(s): {', '.join(sorted(unknown))}")
        return cls(model_path=model_path, **kwargs)
