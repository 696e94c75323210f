"""Llama-4 (`Llama4ForConditionalGeneration`, and the text-only `Llama4ForCausalLM`): our decoder over the paged KV
cache (layers/llama4_decoder.py: MoE and dense layers, chunked-local RoPE layers and global NoPE layers, qk L2
norm, temperature tuning) + transformers' vision tower + the projector.

An image is tiles of `image_size` x `image_size` (a rows x cols grid, and, when there is more than one tile, the
whole image resized to one tile after them: the image processor's order). transformers' Llama4VisionModel turns
each tile into (image_size / patch_size)^2 patch features, drops the CLS token, pixel-shuffles them down by
pixel_shuffle_ratio^2 and runs its vision adapter; `multi_modal_projector.linear_1` maps them to the text width.
Every tile's features fill one run of `<|patch|>` tokens (config.image_token_index), in order: the processor
writes the runs of one image separated by tile separators and `<|image|>` (tessera.multimodal.processors.llama4).
All tiles of a step's images go through the tower in one call.
"""

from __future__ import annotations


import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.layers.linear import Linear
from tessera.layers.llama4_decoder import Llama4DecoderModel
from tessera.models.base import Encoder
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.weights import WeightMapping
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.geometry import tokens_per_tile

VISION_TOWER = "transformers.models.llama4.modeling_llama4:Llama4VisionModel"


class Llama4MultiModalProjector(nn.Module):
    """Vision adapter output (vision_output_dim) -> the text width: one unbiased linear, `linear_1`."""

    def __init__(self, in_features: int, text_hidden: int):
        super().__init__()
        self.linear_1 = Linear(in_features, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4ForCausalLM(CausalLM):
    """The text model alone (`model.*`, `lm_head.*`)."""

    decoder_model_class = Llama4DecoderModel
    cuda_graph_decode = False  # chunked-attention masks are planned on the host


class Llama4ForConditionalGeneration(CausalLM):
    """Items carry `feature` (tiles [n, C, image_size, image_size], the global image last) or a
    `precomputed_embedding` [n * tokens_per_tile, hidden]."""

    decoder_model_class = Llama4DecoderModel
    cuda_graph_decode = False  # chunked-attention masks are planned on the host

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        vision = config.hf_config.vision_config
        self.tile_shape = (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))
        self.tokens_per_tile = tokens_per_tile(vision)
        self.vision_model: nn.Module | None = None
        self.multi_modal_projector: Llama4MultiModalProjector | None = None
        if not language_model_only:
            self.vision_model = build_transformers_tower(VISION_TOWER, vision)
            self.multi_modal_projector = Llama4MultiModalProjector(int(vision.vision_output_dim), config.hidden_size)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """The names transformers saves (`language_model.model.*`, `language_model.lm_head.*`, `vision_model.*`,
        `multi_modal_projector.*`); tied embeddings drop the head."""
        tower = None if language_model_only else "vision_model."
        projector = None if language_model_only else "multi_modal_projector."
        lm_head = None if config.tie_word_embeddings else "lm_head."
        return WeightMapping(
            prefix_rules=(
                ("language_model.lm_head.", lm_head),
                ("language_model.model.", "model."),
                ("vision_model.", tower),
                ("multi_modal_projector.", projector),
            ),
            stacked=STACKED_PARAMS,
            stacked_prefix="model.",  # the vision tower keeps transformers' separate q/k/v projections
        )

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_model is None else {Modality.IMAGE: self.get_image_feature}

    def tile_features(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles [n, C, S, S] -> projected features [n, tokens_per_tile, hidden]."""
        if self.vision_model is None or self.multi_modal_projector is None:
            raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
        features = self.vision_model(tiles, return_dict=True).last_hidden_state
        return self.multi_modal_projector(features)

    def item_tiles(self, i: int, item: MultimodalDataItem) -> torch.Tensor:
        feature = item.feature
        if feature is None or feature.dim() != 4 or tuple(feature.shape[1:]) != self.tile_shape:
            shape = None if feature is None else tuple(feature.shape)
            raise ValueError(f"image item {i}: pixel feature has shape {shape}, the vision tower takes tiles "
                             f"[n, {', '.join(map(str, self.tile_shape))}]")
        return feature

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tiles * tokens_per_tile, hidden] per image item, in order; every tile of every pixel
        item in one tower call. Precomputed embeddings pass through (cast to the model's dtype/device)."""
        weight = self.model.embed_tokens.like
        tiles = {i: self.item_tiles(i, item) for i, item in enumerate(items) if item.precomputed_embedding is None}

        def encode(todo: list[int]) -> list[torch.Tensor]:
            batch = torch.cat([tiles[i] for i in todo]).to(device=weight.device, dtype=weight.dtype)
            features = self.tile_features(batch).split([tiles[i].shape[0] for i in todo])
            return [f.reshape(-1, f.shape[-1]) for f in features]

        return self.encode_items(items, encode)
