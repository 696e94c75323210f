"""DeepSeek-V3's text decoder (Kimi-K2's) over the paged KV cache: pre-norm layers of multi-head latent attention
(layers/mla.py) and a feed-forward that is a dense gated MLP on the first `first_k_dense_replace` layers and a
mixture of experts (layers/deepseek_moe.py) on the rest (every `moe_layer_freq`-th of them: DeepSeek's and
SGLang's rule; transformers reads only first_k_dense_replace, the same layers for the freq 1 every checkpoint has).

Parameter names follow transformers' `model.layers.N.self_attn.*` / `mlp.*`; the query's and the latent's input
projections are one fused matmul (`self_attn.qkv_a_proj`), dense gate/up too (`mlp.gate_up_proj`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderDims, DecoderLayer, DecoderOptions, GatedMLP
from tessera.layers.deepseek_moe import DeepseekMoE
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import VocabParallelEmbedding
from tessera.layers.mla import MLAttention, ScaledRotaryEmbedding
from tessera.layers.norm import RMSNorm


def is_moe_layer(text: Any, layer_id: int) -> bool:
    first = int(getattr(text, "first_k_dense_replace", None) or 0)
    freq = int(getattr(text, "moe_layer_freq", None) or 1)
    return bool(getattr(text, "n_routed_experts", None)) and layer_id >= first and layer_id % freq == 0


class DeepseekDecoderLayer(DecoderLayer):
    """The shared pre-norm block (its forward) over MLA and the dense or MoE feed-forward."""

    def __init__(self, text: Any, layer_id: int, attn_backend: BaseAttentionBackend):
        nn.Module.__init__(self)  # not DecoderLayer's: its attention is the GQA one
        hidden, eps = int(text.hidden_size), float(text.rms_norm_eps)
        self.self_attn = MLAttention(text, layer_id, attn_backend)
        self.mlp: nn.Module = (DeepseekMoE(text) if is_moe_layer(text, layer_id) else
                               GatedMLP(hidden, int(text.intermediate_size), str(text.hidden_act)))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None  # the shared forward's GLM-4 norms: none


class DeepseekDecoderModel(nn.Module):
    """Embedding table, decoder layers and final norm: `model.*` (transformers' DeepseekV3Model)."""

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, attn_backend: BaseAttentionBackend):
        super().__init__()
        text = cfg.hf_config.get_text_config()
        self.attn_backend = attn_backend
        tp = tp_group()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(text, i, attn_backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = ScaledRotaryEmbedding(text, int(text.qk_rope_head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        """x: input embeddings [T, H]; positions [T]. Returns the final-norm hidden states [T, H]."""
        cos, sin = self.rotary_emb.get_cos_sin(positions, x.dtype)
        self.attn_backend.init_forward_metadata(fb)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, fb, pool)
        if residual is None:
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x
