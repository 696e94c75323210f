"""Messages between the frontend and the scheduler process (encoded by messages/codec.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tessera.messages.finish import FinishReason
from tessera.messages.items import MultimodalInputs
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams
from tessera.messages.worker import WorkerInfo


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    mm_inputs: MultimodalInputs | None = None
    stream: bool = False
    return_logprob: bool = False
    # SGLang's logprob_start_len: >= 0 asks the prompt tokens' logprobs from that position on; -1: none.
    logprob_start_len: int = -1
    # Requests with different salts never share prefix-cache entries (vLLM's cache_salt).
    cache_salt: str | None = None
    prompt_logprob_ranks: bool = False  # with prompt logprobs, each prompt token's rank too
    lora_name: str | None = None  # the LoRA adapter this request runs with (None: the base model)
    pooling: PoolingParams | None = None  # an embedding request: prefill only, answered with a pooled vector


@dataclass
class TokenizedBatchReq:
    """Many requests in one message (a batch of embedding requests, frontend/embed_batch.py): one send and one
    receive instead of one per request; the scheduler takes each as if it had come alone."""

    reqs: list[TokenizedGenerateReq]


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetStatsReq:
    pass


@dataclass
class LoraAdapterReq:
    """Load adapter `lora_name` from `lora_path` (None: unload it); answered by a LoraAdapterResult."""

    op_id: str
    lora_name: str
    lora_path: str | None = None


@dataclass
class LoraAdapterResult:
    op_id: str
    error: str | None = None  # one line: why the adapter was refused (None: done)
    status: int = 400  # the HTTP status of the error: 400 a bad adapter, 404 an unknown name, 409 in use
    dp_rank: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    radix_cache_tokens: int
    prefix_hit_tokens: int
    prefix_total_tokens: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    encoder_cache_bytes: int
    cross_kv_used_tokens: int  # encoder-decoder models: pool slots held by cross-attention K/V (in kv_used_tokens)
    num_forward_steps: int
    num_prefill_tokens_computed: int
    num_retractions: int
    num_steps_all_cores: int = 0  # CPU: model steps that ran with every core's thread (adaptive threads)
    dp_rank: int = 0  # the data-parallel replica these counters are of
    # Media payload received from the frontend: tensor bytes per modality ("image", "video", "audio"), and how
    # many items came as deferred raw pixels vs eager features / embeddings.
    mm_transport_bytes: dict[str, int] = field(default_factory=dict)
    mm_transport_bytes_total: int = 0  # the sum over modalities
    mm_deferred_items: int = 0
    mm_eager_items: int = 0
    # Seconds the device computed model steps, and sat idle between consecutive steps while there was work
    # (platform/device.py StepClock): the share an overlap scheduler would win back.
    device_busy_s: float = 0.0
    device_idle_s: float = 0.0
    # Speculative decoding: request-steps that verified drafts, the drafts they scored and those accepted.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_accept_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the step's own token); 0 before the first."""
        return 1 + self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 0.0

    @property
    def spec_accept_rate(self) -> float:
        """Accepted drafts / drafts scored; 0 before the first."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0
    num_embedding_requests: int = 0  # embedding requests answered (prefill only, pooled)

    @property
    def device_idle_fraction(self) -> float:
        """Idle between steps / (idle + busy); 0 before the first two steps."""
        total = self.device_busy_s + self.device_idle_s
        return self.device_idle_s / total if total > 0 else 0.0

    def report(self) -> dict:
        """The counters as get_server_info's "stats" shows them, with the idle fraction."""
        return {**dataclasses.asdict(self), "device_idle_fraction": round(self.device_idle_fraction, 4),
                "spec_accept_length": round(self.spec_accept_length, 4),
                "spec_accept_rate": round(self.spec_accept_rate, 4)}

    @classmethod
    def sum(cls, parts: list[SchedulerStats]) -> SchedulerStats:
        """The counters of several replicas added up (dp_rank -1: a total)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "dp_rank"]
        return cls(**{n: _add([getattr(p, n) for p in parts]) for n in names}, dp_rank=-1 if len(parts) > 1 else
                   (parts[0].dp_rank if parts else 0))


def _add(values: list) -> Any:
    """Sum of counters; dicts of counters add key by key."""
    if values and isinstance(values[0], dict):
        out: dict = {}
        for v in values:
            for k, x in v.items():
                out[k] = out.get(k, 0) + x
        return out
    return sum(values)


@dataclass
class ReqOutput:
    """Incremental output of one request since the last message about it."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None = None  # set on the request's last output
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs, once (with the first output after the prompt's prefill), in SGLang's order: per prompt
    # token from logprob_start_len, (logprob or None for the first token, token id); alternatives (logprob, id).
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_token_ranks: list[int | None] | None = None  # each prompt token's rank, when asked
    # Speculative decoding, so far: the request's verify steps and the drafts they accepted (SGLang's meta_info
    # spec_verify_ct and spec_accept_length come from them).
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    embedding: Any = None  # an embedding request's pooled vector (float32 torch tensor [dims]), once, at the end


@dataclass
class BatchOutput:
    outputs: list[ReqOutput] = field(default_factory=list)


@dataclass
class SchedulerReady:
    worker: WorkerInfo  # the effective device, dtype, KV pool size, ...


@dataclass
class SchedulerError:
    message: str  # one line: what failed
    traceback: str = ""  # for the server log at debug level, never for users
