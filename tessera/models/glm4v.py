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

GLM-4.5V / 4.6V (`Glm4vMoeForConditionalGeneration`) share the tower, the processor and the positions; their
language model is GLM-4.5's: plain pre-norm layers (no sandwich norms), RoPE on half of each head rotating halves
(transformers' rotate_half), q/k/v biased as `attention_bias` says, and from layer `first_k_dense_replace` on a
mixture of experts that is DeepSeek-V3's block as it is (layers/deepseek_moe.DeepseekMoE, Kimi-K2's): sigmoid
scores, the choice biased by e_score_correction_bias and limited to the topk_group best of n_group groups, weights
normalised and scaled by routed_scaling_factor, the routed experts through the shared grouped path, plus the
shared experts' gated MLP. The checkpoint keeps one weight per expert (PerExpertMapping places them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderDims, DecoderLayer, DecoderModel, DecoderOptions
from tessera.layers.deepseek_moe import DeepseekMoE
from tessera.models.config import ModelConfig
from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration
from tessera.models.weights import WeightMapping

GLM4_OPTIONS = DecoderOptions(qkv_bias=True, rotary_pairs=True, post_block_norms=True)


def glm4_decoder_options(config: ModelConfig, base: DecoderOptions = GLM4_OPTIONS) -> DecoderOptions:
    rope = dict(getattr(config.hf_config.get_text_config(), "rope_parameters", None) or {})
    # transformers' rotary for GLM-4V: rope_parameters.partial_rotary_factor, else the whole head.
    return replace(base, partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)))


class Glm4vForConditionalGeneration(Qwen2VLForConditionalGeneration):
    decoder_options = GLM4_OPTIONS
    vision_tower: ClassVar[str] = "transformers.models.glm4v.modeling_glm4v:Glm4vVisionModel"
    fused_gate_up: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        self.decoder_options = self.options_for(config)  # read by CausalLM.__init__
        if config.rope_type != "default":
            raise NotImplementedError(f"rope_parameters.rope_type={config.rope_type!r}: GLM-4V supports default RoPE")
        vision = config.hf_config.vision_config
        if int(vision.out_hidden_size) != config.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={vision.out_hidden_size} differs from the language "
                             f"model's hidden_size={config.hidden_size}")
        super().__init__(config, attn_backend, language_model_only)

    @staticmethod
    def options_for(config: ModelConfig) -> DecoderOptions:
        return glm4_decoder_options(config)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """Qwen2-VL's names; GLM-4's MLP keeps gate and up in one `gate_up_proj` ([gate; up] rows)."""
        mapping = super().weight_mapping(config, language_model_only)
        return replace(mapping, fused=(("gate_up_proj", ("gate_proj", "up_proj")),)) if cls.fused_gate_up else mapping

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Every grid row (t, h, w) goes through the tower as t frames of (1, h, w), in order (for an image t = 1)."""
        assert self.visual is not None
        frames = grid_thw.repeat_interleave(grid_thw[:, 0], dim=0)
        frames[:, 0] = 1
        return self.visual(pixel_rows, grid_thw=frames).pooler_output


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class PerExpertMapping(WeightMapping):
    """GLM-4.5V checkpoints keep one F.linear weight per expert and projection (`mlp.experts.3.gate_proj.weight`;
    transformers stacks them at load and unstacks them at save): each goes to its slice of the experts' stacks
    (layers/deepseek_moe.ExpertStack: `experts.gate_up` shard "3.gate", `experts.down` shard "3")."""

    def map_name(self, name: str) -> tuple[str, str | None] | None:
        m = _EXPERT.match(name)
        if m is None:
            return super().map_name(name)
        target = super().map_name(f"{m.group(1)}.weight")  # the prefix rules only: no stacked segment in it
        if target is None:
            return None
        stack, expert, proj = target[0].removesuffix(".weight"), m.group(2), m.group(3)
        return (f"{stack}.down.weight", expert) if proj == "down" else (f"{stack}.gate_up.weight", f"{expert}.{proj}")


class Glm4vMoeDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        text = cfg.hf_config.get_text_config()
        if layer_id < int(text.first_k_dense_replace):
            return super().build_mlp(cfg, layer_id)
        return DeepseekMoE(text)


class Glm4vMoeTextModel(DecoderModel):
    layer_class = Glm4vMoeDecoderLayer


class Glm4vMoeForConditionalGeneration(Glm4vForConditionalGeneration):
    decoder_model_class = Glm4vMoeTextModel
    vision_tower: ClassVar[str] = "transformers.models.glm4v_moe.modeling_glm4v_moe:Glm4vMoeVisionModel"
    fused_gate_up = False  # GLM-4.5's dense MLPs keep gate_proj and up_proj apart
    cuda_graph_decode = True  # the DeepSeek router and the grouped experts' Triton kernel read nothing back

    @staticmethod
    def options_for(config: ModelConfig) -> DecoderOptions:
        bias = bool(getattr(config.hf_config.get_text_config(), "attention_bias", True))
        return glm4_decoder_options(config, DecoderOptions(qkv_bias=bias))

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        mapping = super().weight_mapping(config, language_model_only)
        return PerExpertMapping(**{f.name: getattr(mapping, f.name) for f in fields(mapping)})

