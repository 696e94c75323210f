"""Qwen3-Next (`Qwen3NextForCausalLM`): the hybrid decoder (layers/hybrid_decoder.py: Gated DeltaNet layers with
their state in the state pool, gated full-attention layers over the paged KV) with Qwen2-MoE feed-forwards (routed
experts plus a gated shared expert, layers/moe.SharedExpertMoE) where transformers builds them, else a gated MLP.

HybridLM is what every hybrid family shares: its K/V is the full-attention layers' only, its per-request state
is `state_layout` (cache/state_pool.py), and its decode step reads request rows on the host (no CUDA graphs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from torch import nn

from tessera.cache.state_pool import LinearStateLayout
from tessera.layers.decoder import DecoderDims
from tessera.layers.hybrid_decoder import HybridDecoderLayer, HybridDecoderModel, state_layout
from tessera.layers.moe import SharedExpertMoE
from tessera.models.causal_lm import CausalLM
from tessera.models.config import KVLayout, ModelConfig
from tessera.models.weights import WeightMapping
from tessera.models.qwen3_vl_moe import moe_layer_ids


class HybridLM:
    """Mixin for a CausalLM whose `model` is a HybridDecoderModel."""

    cuda_graph_decode: ClassVar[bool] = False  # the linear-attention layers plan each step from host ints

    @property
    def kv_layout(self) -> KVLayout:
        cfg = self.config  # type: ignore[attr-defined]
        return KVLayout(self.model.num_full_layers, cfg.num_kv_heads, cfg.head_dim)  # type: ignore[attr-defined]

    @property
    def state_layout(self) -> LinearStateLayout:
        return state_layout(self.config.hf_config.get_text_config())  # type: ignore[attr-defined]


def shared_expert_moe(cfg: DecoderDims, layer_id: int, every_layer: bool = False) -> nn.Module | None:
    """Layer layer_id's Qwen2-MoE block, or None where transformers keeps a dense MLP (Qwen3-Next's
    decoder_sparse_step / mlp_only_layers; Qwen3.5-MoE: every layer, the top-k always renormalised)."""
    text = cfg.hf_config.get_text_config()
    if not every_layer and layer_id not in moe_layer_ids(text):
        return None
    return SharedExpertMoE(cfg.hidden_size, int(text.moe_intermediate_size), int(text.num_experts),
                           int(text.num_experts_per_tok), cfg.hidden_act, bool(getattr(text, "norm_topk_prob", True)),
                           int(text.shared_expert_intermediate_size))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    fused_qkvz = True


class Qwen3NextModel(HybridDecoderModel):
    layer_class = Qwen3NextDecoderLayer

    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        return shared_expert_moe(cfg, layer_id) or super().build_mlp(cfg, layer_id)


class Qwen3NextForCausalLM(HybridLM, CausalLM):
    decoder_model_class = Qwen3NextModel

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        return replace(super().weight_mapping(config, language_model_only), per_expert=True)
