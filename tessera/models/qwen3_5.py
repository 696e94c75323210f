"""Qwen3.5 (`Qwen3_5ForConditionalGeneration`, dense; `Qwen3_5MoeForConditionalGeneration`): natively
multimodal Qwen3-VL (its vision tower without DeepStack, interleaved M-RoPE, the same processor) over the hybrid
decoder of Qwen3-Next (layers/hybrid_decoder.py): Qwen3.5's linear-attention layers project q/k/v, z, b and a
apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), and its rotary covers `partial_rotary_factor` of each head.
The MoE variant's sparse layers are Qwen3-Next's (routed experts plus a gated shared expert).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from tessera.layers.decoder import DecoderDims
from tessera.layers.hybrid_decoder import HybridDecoderModel, rotary_dim
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.qwen3_next import HybridLM, shared_expert_moe
from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration
from tessera.models.weights import WeightMapping


class Qwen3_5ForConditionalGeneration(HybridLM, Qwen3VLForConditionalGeneration):
    decoder_model_class = HybridDecoderModel
    vision_tower: ClassVar[str] = "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel"

    def rotary_dim(self, config: ModelConfig) -> int:
        return rotary_dim(config)

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        assert self.visual is not None
        return self.visual(pixel_rows, grid_thw=grid_thw).pooler_output  # no DeepStack levels


class Qwen3_5MoeTextModel(HybridDecoderModel):
    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        moe = shared_expert_moe(cfg, layer_id, every_layer=True)
        assert moe is not None
        return moe


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    decoder_model_class = Qwen3_5MoeTextModel
    vision_tower: ClassVar[str] = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeVisionModel"

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        return replace(super().weight_mapping(config, language_model_only), per_expert=True)  # experts kept apart


class Qwen3_5ForCausalLM(HybridLM, CausalLM):
    """Qwen3.5's text model alone (`Qwen3_5ForCausalLM`, config model_type qwen3_5_text): text positions give
    every M-RoPE row the same angle, so its interleaved M-RoPE is 1-D RoPE over the rotary part of each head."""

    decoder_model_class = HybridDecoderModel


class Qwen3_5MoeForCausalLM(HybridLM, CausalLM):
    decoder_model_class = Qwen3_5MoeTextModel

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        return replace(super().weight_mapping(config, language_model_only), per_expert=True)
