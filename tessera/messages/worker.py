"""The scheduler -> worker step message and its answer.

ForwardInput holds everything a model worker needs for one step and nothing it must ask back for: token
ids, positions, KV slots (the new tokens' slots plus the slot-table writes since the last step), per-request
lengths, the media items to encode and where their embedding rows go, and the sampling parameters. It is
a plain dataclass of tensors, ints and lists, encoded by messages/codec.py when it crosses a process
(the same message is meant for every tensor-parallel rank). The worker answers with a StepOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.messages.items import MultimodalDataItem
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams


@dataclass
class SlotWrite:
    """Slot-table write: request row `row` holds its tokens start..start+len(slots)-1 at `slots`."""

    row: int
    start: int
    slots: torch.Tensor  # [n] int64, host

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the table entries written, one per slot."""
        n = self.slots.shape[0]
        return torch.full((n,), self.row, dtype=torch.int64), torch.arange(self.start, self.start + n)

    def written_rows(self) -> list[int]:
        return [self.row]


@dataclass
class TokenSlotWrites:
    """One slot-table entry for each of several requests (a decode step's new tokens, journaled as one
    write rather than one per request): row rows[i], column cols[i] holds slots[i]. Rows are distinct."""

    rows: torch.Tensor  # [n] int64, host
    cols: torch.Tensor  # [n] int64, host
    slots: torch.Tensor  # [n] int64, host

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows, self.cols

    def written_rows(self) -> list[int]:
        return self.rows.tolist()


@dataclass
class MMPlacement:
    """Embedding rows [lo, hi) of mm_items[item] go to flat token rows [row, row + hi - lo)."""

    item: int
    req: int  # index of the request in the step (whose embeddings stay with it across prefill chunks)
    row: int
    lo: int
    hi: int


@dataclass
class RequestStateFill:
    """Families with per-request state (models/request_state.py, an encoder-decoder's cross-attention K/V):
    request `req` of the step gets its state (from its `items`' encoder outputs, in order) written at `slots`
    before the step, and keeps it until it is released."""

    req: int
    items: list[MultimodalDataItem]
    slots: torch.Tensor  # [RequestState.extra_slots] int64, host


@dataclass
class SamplingRow:
    """Sampling inputs of one request that produces a token this step."""

    params: SamplingParams
    output_ids: list[int]  # generated so far (penalties, min_new_tokens, the per-step seed)
    prompt_ids: list[int]  # the prompt, when repetition_penalty or the model's logits rules need it; [] otherwise


@dataclass
class PromptLogprobRows:
    """Prompt log-probabilities asked of this step for request `req`: flat rows [row, row + len(targets))
    predict `targets`, its prompt tokens first_token, first_token + 1, ...; `top` alternatives per row, and
    the targets' ranks when `ranks`."""

    req: int
    row: int
    first_token: int
    targets: list[int]
    top: int = 0
    ranks: bool = False


@dataclass
class PoolingRows:
    """Request `req` of the step (its index in ForwardInput.rids) is an embedding request: flat rows [row, row + n) are its prompt tokens
    start .. start + n - 1; `final`: the prompt's last token is among them, so its pooled vector is returned."""

    req: int
    row: int
    start: int
    n: int
    final: bool
    params: PoolingParams


@dataclass
class ForwardInput:
    rids: list[str]  # per request
    input_ids: torch.Tensor  # [T] int64, requests' new tokens flattened in order
    positions: torch.Tensor  # [T] or [3, T] int64 (the model's prepare_step)
    out_cache_loc: torch.Tensor  # [T] int64 KV slot of each new token
    req_pool_indices: list[int]  # per request: its slot-table row
    req_generations: list[int]  # per request: allocation generation of that row (names its KV across steps)
    seq_lens: list[int]  # per request: KV length after this step
    extend_lens: list[int]  # per request: new tokens this step
    slot_writes: list[SlotWrite | TokenSlotWrites]  # apply in order before the step
    logits_rows: list[int]  # flat rows whose logits are sampled, one per SamplingRow
    sampling: list[SamplingRow]
    mm_items: list[MultimodalDataItem] = field(default_factory=list)
    mm_placements: list[MMPlacement] = field(default_factory=list)
    # Per request: [lo, hi) token ranges attended bidirectionally (None: every request is causal).
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # Requests whose prompt KV is complete after this step: their held embeddings can go after it.
    prompt_done: list[str] = field(default_factory=list)
    # Requests that left (finished, aborted, retracted) since the last step: drop their state first.
    released: list[str] = field(default_factory=list)
    # Per-request state to fill before the step (requests just admitted; RequestStateFill).
    state_fills: list[RequestStateFill] = field(default_factory=list)
    # Grammar bitmask, one row per SamplingRow (tessera/constrained): None when no row is constrained.
    vocab_mask: torch.Tensor | None = None  # [len(sampling), ceil(V / 32)] int32, host
    # JSON rows' closing tokens (sampler.close_on_stop_intent), -1 padded; None when no row has any.
    stop_closers: torch.Tensor | None = None  # [len(sampling), K] int64, host
    # Rows whose logits give prompt log-probabilities (only requests that ask; see worker/prompt_logprobs.py).
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # LoRA (scheduler/lora_slots.py): per request its adapter's slot (-1: the base model); None: no adapters.
    lora_slots: list[int] | None = None
    # Adapters to copy into slots before the step: (slot, adapter name, or None to empty the slot).
    lora_loads: list[tuple[int, str | None]] = field(default_factory=list)
    # Embedding requests' rows (worker/pooling.py): their final hidden states are pooled, never sampled.
    pooling_rows: list[PoolingRows] = field(default_factory=list)
    # Hybrid models (cache/state_pool.py): state-pool copies (source slot, destination slot) to make in order
    # before the step, and saves during it: (request index, its tokens of the step, snapshot slot), the state
    # after that many of the request's new tokens copied to the slot.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # Overlap scheduling (scheduler/overlap.py): input_ids < 0 are the previous step's sampled ids, row -1 - id,
    # which the worker reads on the device (worker/step_launch.py); the host never saw them.
    placeholders: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StepOutput:
    """One entry per SamplingRow, in order; the prompt_* lists have one entry per PromptLogprobRows."""

    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[float]] = field(default_factory=list)  # per entry: one logprob per target
    prompt_top_logprobs: list[list[list[tuple[int, float]]]] = field(default_factory=list)  # per entry, per row
    prompt_ranks: list[list[int]] = field(default_factory=list)  # per entry: targets' ranks (1 = most likely) or []
    # One float32 vector per final PoolingRows entry, in order (host).
    embeddings: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker settled on at startup (reported by /get_server_info)."""

    device: str
    dtype: str  # the weights' (what --dtype resolved to)
    max_total_tokens: int  # KV pool size in tokens
    kv_bytes_per_token: int
    context_length: int
    vocab_size: int
    attention_backend: str
    decode_kv_mirror: bool
    tp_size: int = 1
    num_parameters: int = 0  # of the whole model (every rank's shard; layers.linear.count_parameters)
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # decode batch-size buckets replayed as CUDA graphs; () = off
    # "captured", "off: <why>" or "capture failed, decode runs eagerly: <error>"
    cuda_graph_status: str = ""
    # CPU kernels (platform/cpu_kernels.py): per kernel "loaded", or why not and what runs instead; {} off a CPU.
    cpu_kernels: dict[str, str] = field(default_factory=dict)
    compute_dtype: str = ""  # activations, norms, the KV pool: float32 for 16-bit weights on a CPU
    linear_kernel: str = ""  # how the linear layers' products run (layers/half_linear.py describe())
    # The quantization scheme and what runs it: a pre-quantized checkpoint's ("awq 4-bit g128 asym, C int4 gemv")
    # or --torchao-config's (layers/quantization/int_linear.py); "" for float weights.
    quantization: str = ""
    encode_ahead: bool = False  # media encoded on a thread of their own before their prefill (worker/encode_ahead.py)
    lora_backend: str = ""  # what runs the LoRA products ("" without --enable-lora)
    # Hybrid models: (first slot, count) of the state pool's slots past the request rows: prefix-cache snapshots,
    # then speculative decoding's verify slots (cache/state_pool.verify_slot_count of them).
    state_snapshot_slots: tuple[int, int] = (0, 0)
