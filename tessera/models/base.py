"""The model contract: the one interface through which the scheduler, the worker and the loader use a model.

A model is built from a ModelConfig (`build`), declares how checkpoint names map onto its parameters
(`weight_mapping`), the shape of its K/V (`kv_layout`), its encoders per modality (`encoders`), any K/V it
keeps per request beside its tokens' (`request_state`, an encoder-decoder's cross-attention), and how a
step's tokens are positioned and masked (`prepare_step`, a classmethod: the scheduler calls it without the
model, and its result travels in the ForwardInput). `forward(fb, pool)` returns the logits of the rows
fb.logits_indices.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tessera.models.config import KVLayout, ModelConfig
from tessera.models.weights import WeightMapping
from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.multimodal.mrope import generated_positions, segment_mrope_positions

if TYPE_CHECKING:
    from tessera.cache.kv_pool import TokenToKVPool
    from tessera.cache.state_pool import LinearStateLayout
    from tessera.layers.attention import BaseAttentionBackend
    from tessera.layers.forward_batch import ForwardBatch
    from tessera.messages.worker import SamplingRow
    from tessera.models.request_state import RequestState

# An encoder: items of one modality -> one embedding [num_tokens, hidden] per item, in order.
Encoder = Callable[[list[MultimodalDataItem]], list[torch.Tensor]]


@dataclass(frozen=True)
class StepSegment:
    """One request's tokens in a step, as prepare_step sees them: fill_ids[start:end] of a request whose
    prompt has prompt_len tokens (the rest are generated tokens)."""

    start: int
    end: int
    prompt_len: int
    mm_inputs: MultimodalInputs | None = None


@dataclass
class StepLayout:
    """prepare_step's result for a whole step (requests in order, tokens flattened)."""

    positions: torch.Tensor  # [T] (1-D RoPE) or [3, T] (M-RoPE), int64
    # Per request: absolute [lo, hi) token ranges inside which attention is bidirectional (None: causal only).
    bidirectional_spans: list[list[tuple[int, int]]] | None = None


def rope_positions(seg: StepSegment) -> torch.Tensor:
    return torch.arange(seg.start, seg.end, dtype=torch.long)


def mrope_positions(seg: StepSegment) -> torch.Tensor:
    mm = seg.mm_inputs
    return segment_mrope_positions(seg.start, seg.end, seg.prompt_len, mm.mrope_positions if mm is not None else None,
                                   mm.mrope_position_delta if mm is not None else 0)


# Learned absolute positions (Whisper) index their table with the token index, as 1-D RoPE does.
_POSITIONS = {"rope": rope_positions, "mrope": mrope_positions, "learned": rope_positions}


class TesseraModel(nn.Module):
    """Base of every model. Subclasses set `config` and implement weight_mapping and forward; multimodal
    ones override `encoders`; a family with another position scheme overrides prepare_step."""

    config: ModelConfig
    attn_backend: BaseAttentionBackend  # set by build()
    # A decode step (one token per request, no media) runs on the device alone, planned from device tensors:
    # no host reads, no shapes that depend on values. The worker captures such steps in CUDA graphs
    # (worker/cuda_graph.py); a model opts in once its forward holds to that.
    cuda_graph_decode: ClassVar[bool] = False
    # Per-request K/V beside the tokens' own, filled from an encoder output (models/request_state.py):
    # an encoder-decoder's cross-attention. None: the family keeps none (every decoder-only family).
    request_state: ClassVar[RequestState | None] = None
    # process_logits reads each row's prompt ids (SamplingRow.prompt_ids), which are otherwise sent only
    # when a repetition penalty needs them.
    process_logits_reads_prompt: ClassVar[bool] = False
    # A pre-quantized checkpoint's or --torchao-config's scheme and what runs the linears (set by load_model;
    # "" for float weights).
    quantization: str = ""

    @classmethod
    def build(cls, config: ModelConfig, attn_backend: BaseAttentionBackend,
              language_model_only: bool = False) -> TesseraModel:
        """The model on the current default device and dtype, parameters allocated but not initialised;
        `attn_backend` is kept as the model's (the worker reads its features)."""
        model = cls(config, attn_backend, language_model_only)  # type: ignore[call-arg]
        model.attn_backend = attn_backend
        return model

    @classmethod
    @abstractmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """Checkpoint tensor names -> our parameter names (language_model_only drops the encoders')."""

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    @property
    def state_layout(self) -> LinearStateLayout | None:
        """Per-request linear-attention state (hybrid models: cache/state_pool.py); None: the model keeps none."""
        return None

    def encoders(self) -> dict[Modality, Encoder]:
        """Modality -> encoder. Empty for text-only models and language-model-only loads."""
        return {}

    def lora_on_token_rows(self, module: str) -> bool:
        """Whether a LoRA adapter on our linear `module` runs on a step's token rows, each row with its request's
        adapter (the decoder, `model.`), rather than on an encoder call's rows, one adapter per call (towers,
        projectors; layers/lora)."""
        return module.startswith("model.")

    @classmethod
    def prepare_step(cls, config: ModelConfig, segments: Sequence[StepSegment]) -> StepLayout:
        """Positions of the step's tokens (the family's scheme) and, for families whose media attend
        bidirectionally, each request's media spans."""
        position_fn = _POSITIONS[config.positions]
        mrope = config.positions == "mrope"
        # Generated tokens (decode) continue the prompt's positions by a per-request delta: collected as ints
        # and made into one tensor per run of them, instead of a few small tensors per request.
        pieces: list[torch.Tensor] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                t = torch.tensor(run, dtype=torch.long)
                pieces.append(t.expand(3, -1) if mrope else t)
                run.clear()

        for seg in segments:
            if seg.start >= seg.prompt_len:
                delta = seg.mm_inputs.mrope_position_delta if mrope and seg.mm_inputs is not None else 0
                run.extend(generated_positions(seg.start, seg.end, delta))
            else:
                flush()
                pieces.append(position_fn(seg))
        flush()
        positions = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
        spans = ([s.mm_inputs.spans() if s.mm_inputs is not None else [] for s in segments]
                 if config.family.bidirectional_mm_spans else None)
        return StepLayout(positions, spans)

    @abstractmethod
    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab]; writes every layer's K/V of the new tokens into pool."""

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The family's own decoding rules on the step's [B, V] logits (after penalties, before sampling), one
        row per SamplingRow. Default: none (Whisper suppresses tokens and pairs timestamps)."""
        return logits
