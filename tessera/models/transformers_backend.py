"""The Transformers backend (`--model-impl transformers`): a model's own transformers modeling code run under the
model contract, with our paged attention plugged in through transformers' attention interface.

The checkpoint loads with transformers' `from_pretrained` (its own key conversions included), the text model's
attention implementation set to TESSERA_ATTENTION, a function registered in `transformers.AttentionInterface`;
the towers keep transformers' default (sdpa). Each step runs the whole top-level forward as one sequence (batch 1,
every request's tokens flattened) with our positions (`position_ids`; M-RoPE ones [3, 1, T]) and our merged
embeddings (`inputs_embeds`), and asks for the logits of the sampled rows only (`logits_to_keep` as indices), so a
family's own final scaling (soft-capping) runs as in transformers. The attention function finds the step's
ForwardBatch and pool through the `_StepScope` every text attention module holds (set for the forward only) and
runs our backend for `module.layer_idx`: it writes the new K/V into the pool and attends per request over its
pages (prefill, chunked prefill, decode, mixed batches; custom masks for bidirectional spans). No mask reaches it:
TESSERA_ATTENTION has no entry in `AttentionMaskInterface`, so transformers skips building one.

Media go through the model's own feature functions (`get_image_features`, `get_video_features`): an item's
`feature` is the first argument, its model_specific_data fill the rest by name (the processor's outputs:
image_sizes, pixel_attention_mask, image_grid_thw, batch_num_images, ...); the result is flattened to the
placeholder rows in prompt order, which is how transformers' `masked_scatter` places it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.forward_batch import ForwardBatch
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder, StepLayout, StepSegment, TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.mm_embed import item_embeddings, merge_mm_embeddings
from tessera.models.transformers_layers import adopt_our_layers
from tessera.models.transformers_family import (
    POSITION_OFFSETS,
    TESSERA_ATTENTION,
    hf_model_class,
    text_config_key,
)
from tessera.models.weights import WeightMapping

# transformers' feature function per modality, on the model or its inner `model`.
_FEATURE_FUNCTIONS = {Modality.IMAGE: "get_image_features", Modality.VIDEO: "get_video_features",
                      Modality.AUDIO: "get_audio_features"}


class _StepScope:
    """The step a forward runs (set by TransformersModel.forward for its duration; None between steps)."""

    def __init__(self, backend: BaseAttentionBackend):
        self.backend = backend
        self.fb: ForwardBatch | None = None
        self.pool: TokenToKVPool | None = None


def tessera_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      *_mask: Any, scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, **_kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our paged pool: q/k/v [1, heads, T, dim] of the step's
    flattened tokens -> ([1, T, heads, dim], no weights). The mask (the fifth argument) is not read: transformers makes none
    for this implementation (no AttentionMaskInterface entry), and each request's mask is ours (causal, with the
    family's bidirectional spans as custom masks)."""
    scope: _StepScope | None = getattr(module, "tessera_scope", None)
    if scope is None or scope.fb is None or scope.pool is None:
        raise RuntimeError(f"{type(module).__name__} ran Tessera's attention outside a Tessera step")
    if softcap is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by Tessera's attention backends")
    assert query.shape[0] == 1, "Tessera runs a step as one flattened sequence"
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    head_dim = q.shape[-1]
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    out = scope.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), int(module.layer_idx), scope.fb,
                                scope.pool, scale, sliding_window)
    return out.view(1, q.shape[0], q.shape[1], head_dim), None


class TransformersModel(TesseraModel):
    """A transformers model under the model contract (see the module docstring)."""

    # Off (the worker logs it at start): transformers' modeling code may branch on values and shapes in Python
    # (position and mask helpers, `torch_compilable_check`s), which a captured graph would replay unchanged.
    cuda_graph_decode: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, hf_model: torch.nn.Module, attn_backend: BaseAttentionBackend,
                 language_model_only: bool = False):
        super().__init__()
        self.config = config
        self.hf = hf_model
        self.attn_backend = attn_backend
        self.language_model_only = language_model_only
        self.scope = _StepScope(attn_backend)
        text = config.hf_config.get_text_config()
        attention = [m for m in hf_model.modules()
                     if getattr(getattr(m, "config", None), "_attn_implementation", None) == TESSERA_ATTENTION
                     and hasattr(m, "layer_idx") and "Attention" in type(m).__name__]
        if len(attention) != int(text.num_hidden_layers):
            raise ValueError(f"model_impl: {config.architecture}'s text model has {len(attention)} attention modules "
                             f"with a layer_idx running through the attention interface, not one per layer "
                             f"({text.num_hidden_layers}); it cannot run on the Transformers backend")
        for module in attention:
            object.__setattr__(module, "tessera_scope", self.scope)  # a plain attribute, not a submodule
        self.language_model_prefix = adopt_our_layers(hf_model)
        self.position_offset = POSITION_OFFSETS.get(config.model_type, 0)
        inner = getattr(hf_model, "model", hf_model)
        # modality -> (the model's feature function, its parameters: which processor outputs it takes)
        self._features = {m: (fn, inspect.signature(fn).parameters)
                          for m, name in _FEATURE_FUNCTIONS.items()
                          if (fn := getattr(inner, name, None)) is not None and m in config.family.modalities}

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_path: str | Path, config: ModelConfig, attn_backend: BaseAttentionBackend,
             dtype: torch.dtype, device: torch.device, language_model_only: bool = False) -> TransformersModel:
        """transformers' from_pretrained with our attention in the text model (towers keep their default)."""
        model_cls = hf_model_class(config.architecture)
        key = text_config_key(config.hf_config)
        implementation: str | dict[str, str] = TESSERA_ATTENTION if key is None else {key: TESSERA_ATTENTION}
        hf_model = model_cls.from_pretrained(str(model_path), config=config.hf_config, dtype=dtype,
                                             attn_implementation=implementation)
        return cls(config, hf_model.to(device), attn_backend, language_model_only)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        raise NotImplementedError("the Transformers backend loads its weights with transformers' from_pretrained")

    # ---- media -----------------------------------------------------------------------------------------------

    def encoders(self) -> dict[Modality, Encoder]:
        if self.language_model_only:
            return {}
        return {m: (lambda items, m=m: self.encode(m, items)) for m in self._features}

    def encode(self, modality: Modality, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tokens, hidden] per item, each from one call of the model's feature function."""
        fn, params = self._features[modality]
        first = next(iter(params))
        like = self.hf.get_input_embeddings().weight

        def encode(todo: list[int]) -> list[torch.Tensor]:
            out = []
            for i in todo:
                item = items[i]
                if item.feature is None:
                    raise ValueError(f"{modality.value} item {i}: neither feature nor precomputed_embedding is set")
                kwargs = {k: v.to(like.device) for k, v in item.model_specific_data.items() if k in params}
                feature = item.feature.to(like.device)
                if feature.is_floating_point():
                    feature = feature.to(like.dtype)
                result = fn(**{first: feature}, **kwargs)
                out.append(_flat_rows(getattr(result, "pooler_output", result), self.config.hidden_size))
            return out

        with torch.inference_mode():
            return item_embeddings(items, encode, like)

    # ---- steps -----------------------------------------------------------------------------------------------

    @classmethod
    def prepare_step(cls, config: ModelConfig, segments: Sequence[StepSegment]) -> StepLayout:
        """The family's positions; a prefix-LM's (PaliGemma's) whole prompt attends bidirectionally."""
        layout = super().prepare_step(config, segments)
        if config.family.prefix_lm:
            layout.bidirectional_spans = [[(0, s.prompt_len)] for s in segments]
        return layout

    @contextmanager
    def _step(self, fb: ForwardBatch, pool: TokenToKVPool):
        self.scope.fb, self.scope.pool = fb, pool
        try:
            yield
        finally:
            self.scope.fb = self.scope.pool = None

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        if fb.hidden_indices is not None:
            raise ValueError("embedding requests are not served by the Transformers backend")
        embed = self.hf.get_input_embeddings()
        ids = fb.input_ids
        if fb.mm_embed_rows is not None:  # placeholder ids may lie outside the vocabulary (PaliGemma's)
            ids = ids.index_fill(0, fb.mm_embed_rows, 0)
        x = merge_mm_embeddings(embed(ids), fb.mm_embed_rows, fb.mm_embeds)
        positions = fb.positions + self.position_offset
        position_ids = positions[:, None, :] if positions.dim() == 2 else positions[None]
        rows = fb.logits_indices
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_lens - 1
        self.attn_backend.init_forward_metadata(fb)
        with self._step(fb, pool):
            out = self.hf(inputs_embeds=x[None], position_ids=position_ids, logits_to_keep=rows, use_cache=False,
                          return_dict=True)
        return out.logits[0]


def _flat_rows(features: Any, hidden: int) -> torch.Tensor:
    """A feature function's output (a tensor, or a list / tuple of per-image tensors) as rows [n, hidden]."""
    if isinstance(features, (list, tuple)):
        return torch.cat([f.reshape(-1, hidden) for f in features])
    return features.reshape(-1, hidden)


def register_attention() -> None:
    """Registers tessera_attention under TESSERA_ATTENTION in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TESSERA_ATTENTION, tessera_attention)
