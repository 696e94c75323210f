"""Qwen2-VL: our Qwen2 language model with M-RoPE over the paged KV cache + its vision tower.

The vision tower is our own (tessera.models.qwen2_vl_vision: transformers' `Qwen2VisionTransformerPretrainedModel`
computation and parameter names: patch embed, ViT blocks with 2D RoPE, patch merger); subclasses whose towers
differ (Qwen2.5-VL, Qwen3-VL) name transformers' class in `vision_tower`. Images and videos of one step
are encoded in ONE tower call each: pixel rows and grid_thw rows are concatenated, items never attend to
each other (the tower attends within each grid_thw row), and the output is split back per item. Its
attention runs over all items at once (tessera.models.vision_attention: one varlen kernel call on CUDA).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.models.base import Encoder
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import (
    batch_vision_attention,
    build_transformers_tower,
    patch_embed_as_matmul,
)
from tessera.models.qwen2 import Qwen2ForCausalLM
from tessera.models.qwen2_vl_vision import Qwen2VisionTower
from tessera.models.weights import WeightMapping
from tessera.messages.items import Modality, MultimodalDataItem


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """The worker encodes media with the encoders() (or takes them from its encoder cache) and puts the
    embedding rows of this step's placeholder tokens into fb.mm_embed_rows / fb.mm_embeds."""

    # None: our own Qwen2VisionTower. A subclass names transformers' tower class ("module:Class") instead; it is
    # built empty and gets our batched attention (and patch embed as a matmul) swapped in.
    vision_tower: ClassVar[str | None] = None

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        vision_config = config.hf_config.vision_config
        self.spatial_merge_size: int = int(vision_config.spatial_merge_size)
        self.visual: torch.nn.Module | None = None if language_model_only else self._build_tower(vision_config)

    def _build_tower(self, vision_config) -> torch.nn.Module:
        if self.vision_tower is None:
            return Qwen2VisionTower(vision_config)
        tower = build_transformers_tower(self.vision_tower, vision_config)
        patch_embed_as_matmul(tower)
        batch_vision_attention(tower)
        return tower

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """transformers 5.x names (`model.language_model.*`, `model.visual.*`, `lm_head.*`) and older ones
        (`model.*`, `visual.*`, `lm_head.*`). More specific prefixes come first."""
        visual = None if language_model_only else "visual."
        return WeightMapping(
            prefix_rules=(
                ("model.language_model.", "model."),
                ("model.visual.", visual),
                ("visual.", visual),
                ("model.", "model."),
                ("lm_head.", None if config.tie_word_embeddings else "lm_head."),
            ),
            stacked=STACKED_PARAMS,
            stacked_prefix="model.",  # the vision tower keeps transformers' own module layout
        )

    def encoders(self) -> dict[Modality, Encoder]:
        if self.visual is None:
            return {}
        return {Modality.IMAGE: self.get_image_feature, Modality.VIDEO: self.get_video_feature}

    # ---- media encoding -------------------------------------------------------------------------------

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tokens, hidden] per image item, in order; all pixel items in one tower call.

        Each item carries `feature` (pixel rows [t*h*w, C*temporal_patch*patch*patch]) and
        model_specific_data["image_grid_thw"] ([1, 3] or [3]), or a `precomputed_embedding` (returned as is,
        cast to the model's dtype/device). num_tokens = t*h*w / spatial_merge_size**2.
        """
        return self._encode(items, "image_grid_thw")

    def get_video_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """As get_image_feature, with model_specific_data["video_grid_thw"]."""
        return self._encode(items, "video_grid_thw")

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower over every item's pixel rows: [sum of tokens, width], items in grid_thw order."""
        assert self.visual is not None
        return self.visual(pixel_rows, grid_thw=grid_thw)

    def _encode(self, items: list[MultimodalDataItem], grid_key: str) -> list[torch.Tensor]:
        weight = self.model.embed_tokens.like
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        for i, item in enumerate(items):
            if item.precomputed_embedding is not None:
                continue
            if item.feature is None:
                raise ValueError(f"item {i}: neither feature nor precomputed_embedding is set")
            if grid_key not in item.model_specific_data:
                raise ValueError(f"item {i}: model_specific_data lacks {grid_key!r}")
            grid = item.model_specific_data[grid_key].reshape(-1, 3).to("cpu", torch.long)
            num_patches = int(grid.prod(-1).sum())
            if item.feature.shape[0] != num_patches:
                raise ValueError(
                    f"item {i}: feature has {item.feature.shape[0]} patch rows, {grid_key} implies {num_patches}"
                )
            pixels.append(item.feature)
            grids.append(grid)

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.visual is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
            rows = torch.cat(pixels).to(device=weight.device, dtype=weight.dtype)
            grid_thw = torch.cat(grids).to(weight.device)
            embeds = self.tower_embeddings(rows, grid_thw).to(weight.dtype)
            merge = self.spatial_merge_size**2
            return list(embeds.split([int(g.prod(-1).sum()) // merge for g in grids]))

        return self.encode_items(items, encode)
