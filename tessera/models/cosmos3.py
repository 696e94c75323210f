"""Cosmos3's understanding towers (NVIDIA's Cosmos3 world models: the vision-language "Reasoner" beside the
diffusion "Generator" in one checkpoint), as transformers 5.24 serves them.

- Cosmos3-Nano (`Cosmos3OmniForConditionalGeneration`, model_type cosmos3_omni) IS Qwen3-VL: same config
  classes, same modules, DeepStack and interleaved M-RoPE. Only its checkpoint differs.
- Cosmos3-Edge (`Cosmos3EdgeForConditionalGeneration`, cosmos3_edge): a dense GQA decoder (no qk-norm) whose MLP
  is fc2(relu(fc1(x))**2), interleaved M-RoPE as Qwen3-VL's (rope_theta 1e8), positions as Qwen3-VL's (a
  video is one timestamped span per frame); a SigLIP2 vision tower over packed patches (transformers'
  `Cosmos3EdgeVisionModel`, its learned position grid resized per image) and a projector (`model.projector`:
  LayerNorm per patch, then the 2x2 patches of a merge block concatenated through a GELU MLP). No DeepStack.

The checkpoints' own layout: the unified checkpoint keeps the Reasoner's text tower at the top level
(`layers.*`, `embed_tokens.*`, `norm.*`) with Diffusers-style attention names (`self_attn.to_q/to_k/to_v/
to_out`, Nano's `norm_q/norm_k`; Edge's MLP as `mlp.up_proj/down_proj`), Nano's vision tower flat (`blocks.*`,
`merger.*`, ...), and the Generator's, sound and action towers' tensors, which the understanding tower does not
use and the mappings drop (transformers' conversion_mapping and `_keys_to_ignore_on_load_unexpected`).
transformers' save_pretrained writes that layout back, the fixtures' checkpoints included; its in-memory names
(`model.language_model.*`, `model.visual.*`) load too.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import ClassVar

import torch

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import UNGATED_STACKED_PARAMS, DecoderOptions
from tessera.layers.rotary import RotaryEmbedding
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration
from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration
from tessera.models.weights import WeightMapping

# The Reasoner's text tower at the checkpoint's top level, and its Diffusers-style attention names.
_TOP_LEVEL_TEXT = (("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."), ("norm.", "model.norm."))
_DIFFUSERS_ATTENTION = ((".self_attn.to_q.", ".self_attn.q_proj."), (".self_attn.to_k.", ".self_attn.k_proj."),
                        (".self_attn.to_v.", ".self_attn.v_proj."), (".self_attn.to_out.", ".self_attn.o_proj."))
# The Generator (its MoT experts and cross-modal projections), the sound and the action towers.
_NANO_GENERATOR = (r"\.add_[qkv]_proj\.", r"\.to_add_out\.", r"\.norm_added_[qk]\.", r"moe_gen",
                   r"^(proj_out|proj_in|time_embedder|audio_proj_out|audio_proj_in|action_proj_out|action_proj_in)\.",
                   r"^(audio|action)_modality_embed$")
_EDGE_GENERATOR = (r"^(model\.language_model\.)?(action_modality_embed$|action_proj_(in|out)\.|time_embedder\.|"
                   r"proj_(in|out)\.|norm_moe_gen\.)",
                   r"layers\.\d+\.(input_layernorm_moe_gen|post_attention_layernorm_moe_gen|mlp_moe_gen)\.",
                   r"layers\.\d+\.self_attn\.(add_[qkv]_proj|to_add_out|norm_added_[qk]|k_norm_und_for_gen)\.")
_ROTARY_BUFFERS = (r"rotary_emb\.inv_freq$",)


class Cosmos3OmniForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Cosmos3-Nano's understanding tower: Qwen3-VL over the unified checkpoint's names."""

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        base = super().weight_mapping(config, language_model_only)
        visual = None if language_model_only else "visual."
        flat_visual = tuple((p, None if visual is None else visual + p) for p in
                            ("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list."))
        return WeightMapping(
            prefix_rules=base.prefix_rules + _TOP_LEVEL_TEXT + flat_visual, stacked=base.stacked,
            stacked_prefix=base.stacked_prefix, ignore=_ROTARY_BUFFERS + _NANO_GENERATOR,
            renames=_DIFFUSERS_ATTENTION + ((".self_attn.norm_q.", ".self_attn.q_norm."),
                                            (".self_attn.norm_k.", ".self_attn.k_norm.")))


class Cosmos3EdgeForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Cosmos3-Edge's understanding tower. The vision tower (`visual`) and the projector (`projector`) are
    transformers' own modules; an item's rows are the projector's outputs, one per 2x2 merge block."""

    vision_tower: ClassVar[str] = "transformers.models.cosmos3_edge.modeling_cosmos3_edge:Cosmos3EdgeVisionModel"
    projector_class: ClassVar[str] = "transformers.models.cosmos3_edge.modeling_cosmos3_edge:Cosmos3EdgePatchMerger"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        text = config.hf_config.get_text_config()
        if getattr(text, "mlp_bias", False):
            raise NotImplementedError("text_config.mlp_bias=True: Cosmos3 Edge checkpoints have unbiased MLPs")
        bias = bool(getattr(text, "attention_bias", False))
        self.decoder_options = DecoderOptions(qkv_bias=bias, o_bias=bias, ungated_mlp=True)  # read by CausalLM
        # transformers never ties Edge's LM head to its embeddings (no tied keys), whatever the config says.
        super().__init__(dataclasses.replace(config, tie_word_embeddings=False), attn_backend, language_model_only)
        self.model.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, list(config.mrope_section),
                                                mrope_interleaved=True)
        self.projector: torch.nn.Module | None = None
        if not language_model_only:
            from transformers.initialization import no_init_weights

            module, name = self.projector_class.split(":")
            projector_cls = getattr(importlib.import_module(module), name)
            with no_init_weights():  # the checkpoint fills it
                self.projector = projector_cls(config.hf_config)

    def _build_tower(self, vision_config) -> torch.nn.Module:
        # transformers' SigLIP2 tower as is: it attends within each image (frame) by its own packed-sequence split.
        return build_transformers_tower(self.vision_tower, vision_config)

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        assert self.visual is not None and self.projector is not None
        return self.projector(self.visual(pixel_rows, grid_thw=grid_thw).last_hidden_state)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        drop = language_model_only
        return WeightMapping(
            prefix_rules=(("model.language_model.", "model."), ("model.visual.", None if drop else "visual."),
                          ("model.projector.", None if drop else "projector."), *_TOP_LEVEL_TEXT,
                          ("lm_head.", "lm_head.")),
            # transformers renames these in the whole checkpoint, so its save writes the tower's q/k/v and MLP
            # under the text tower's stored names too (a real checkpoint keeps the tower's own).
            renames=_DIFFUSERS_ATTENTION + ((".mlp.up_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2.")),
            stacked=UNGATED_STACKED_PARAMS, stacked_prefix="model.", ignore=_ROTARY_BUFFERS + _EDGE_GENERATOR)


__all__ = ["Cosmos3EdgeForConditionalGeneration", "Cosmos3OmniForConditionalGeneration"]
