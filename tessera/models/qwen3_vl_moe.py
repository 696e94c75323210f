"""Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, Qwen3-VL-30B-A3B / 235B-A22B): Qwen3-VL (vision tower,
DeepStack, interleaved M-RoPE, the same processor) with sparse mixture-of-experts feed-forwards.

As transformers' Qwen3VLMoeTextDecoderLayer: layer i is a MoE layer when i is not in `mlp_only_layers`,
`num_experts` > 0 and (i + 1) % `decoder_sparse_step` == 0; the others keep a dense gated MLP of
`intermediate_size`. A MoE layer (layers/moe.SoftmaxTopKMoE) routes each token by a softmax over all experts,
keeps the top `num_experts_per_tok` renormalised to sum to 1 (always: this config has no norm_topk_prob) and
sums the chosen experts' outputs (each of `moe_intermediate_size`) weighted so; there is no shared expert.
The experts are stacked ([E, 2I, H] and [E, H, I] as transformers 5 saves them, or the transposed layout of the
original checkpoints; StackedExperts takes both) and run through the shared grouped path (a grouped matmul on a
CPU, the Triton MoE kernel on CUDA). Tensor parallelism shards every expert's intermediate dim.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from tessera.layers.decoder import DecoderDims, DecoderLayer, DecoderModel
from tessera.layers.moe import SoftmaxTopKMoE
from tessera.models.qwen3_vl import Qwen3VLForConditionalGeneration


def moe_layer_ids(text) -> frozenset[int]:
    """The layers transformers builds with a sparse MoE block."""
    experts, step = int(text.num_experts), int(text.decoder_sparse_step)
    if experts > 0 and step < 1:
        raise ValueError(f"text_config.decoder_sparse_step={step} must be at least 1")
    dense = {int(i) for i in text.mlp_only_layers or ()}
    return frozenset(i for i in range(int(text.num_hidden_layers))
                     if experts > 0 and i not in dense and (i + 1) % step == 0)


class Qwen3VLMoeDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        text = cfg.hf_config.get_text_config()
        if layer_id not in moe_layer_ids(text):
            return super().build_mlp(cfg, layer_id)
        return SoftmaxTopKMoE(cfg.hidden_size, int(text.moe_intermediate_size), int(text.num_experts),
                              int(text.num_experts_per_tok), cfg.hidden_act)


class Qwen3VLMoeTextModel(DecoderModel):
    layer_class = Qwen3VLMoeDecoderLayer


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    decoder_model_class = Qwen3VLMoeTextModel
    vision_tower: ClassVar[str] = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeVisionModel"
