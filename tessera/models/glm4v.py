"""GLM-4.1V (`Glm4vForConditionalGeneration`): the GLM-4 language model with M-RoPE, plus transformers'
`Glm4vVisionModel`.

The language model is the shared decoder (layers/decoder.py) with GLM-4's options: biased q/k/v, an RMSNorm on
the attention output and on the MLP output before each residual add, and RoPE on the first
head_dim * partial_rotary_factor dims only, rotating adjacent pairs (transformers' rotate_half_llm). The head size
is hidden_size // num_attention_heads (transformers' Glm4vTextAttention reads no head_dim). Its M-RoPE sections
are contiguous, as Qwen2-VL's, over the rotated dims; positions come from the processor
(tessera.multimodal.processors.glm4v: every video frame is its own (1, h, w) grid, as transformers'
Glm4vModel.get_rope_index splits it).

The tower: patch embed, axial 2D RoPE, a learned position grid interpolated to each image, RMSNorm blocks, a
strided conv (`downsample`) over each merge x merge block and a gated merger; its output is out_hidden_size wide,
which must be the language model's hidden size. transformers encodes a video as one (1, h, w) grid per frame
(Glm4vModel.get_video_features), and the interpolated position grid is looked up per grid row, so our videos go
through the tower split the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderOptions
from tessera.models.config import ModelConfig
from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration
from tessera.models.weights import WeightMapping

GLM4_OPTIONS = DecoderOptions(qkv_bias=True, rotary_pairs=True, post_block_norms=True)


def glm4_decoder_options(config: ModelConfig) -> DecoderOptions:
    rope = dict(getattr(config.hf_config.get_text_config(), "rope_parameters", None) or {})
    # transformers' rotary for GLM-4V: rope_parameters.partial_rotary_factor, else the whole head.
    return replace(GLM4_OPTIONS, partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)))


class Glm4vForConditionalGeneration(Qwen2VLForConditionalGeneration):
    decoder_options = GLM4_OPTIONS
    vision_tower: ClassVar[str] = "transformers.models.glm4v.modeling_glm4v:Glm4vVisionModel"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        self.decoder_options = glm4_decoder_options(config)  # read by CausalLM.__init__
        if config.rope_type != "default":
            raise NotImplementedError(f"rope_parameters.rope_type={config.rope_type!r}: GLM-4V supports default RoPE")
        vision = config.hf_config.vision_config
        if int(vision.out_hidden_size) != config.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={vision.out_hidden_size} differs from the language "
                             f"model's hidden_size={config.hidden_size}")
        super().__init__(config, attn_backend, language_model_only)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """Qwen2-VL's names; the checkpoint's MLP keeps gate and up in one `gate_up_proj` ([gate; up] rows)."""
        return replace(super().weight_mapping(config, language_model_only),
                       fused=(("gate_up_proj", ("gate_proj", "up_proj")),))

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Every grid row (t, h, w) goes through the tower as t frames of (1, h, w), in order (for an image t = 1)."""
        assert self.visual is not None
        frames = grid_thw.repeat_interleave(grid_thw[:, 0], dim=0)
        frames[:, 0] = 1
        return self.visual(pixel_rows, grid_thw=frames).pooler_output
