"""Gemma-3's decoder over the paged KV cache: the shared attention and gated MLP with Gemma's differences.

What differs from the shared pre-norm block (layers/decoder.py), as transformers' Gemma3TextModel does it:
- RMSNorm scales by (1 + weight), in float32, cast back after the multiply (GemmaRMSNorm); also on q/k;
- four norms per layer: x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)));
- token embeddings are multiplied by sqrt(hidden_size) rounded to the embedding's dtype;
- attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- sliding and full layers take RoPE from their own parameters (rope_parameters per layer type: a local base
  for sliding layers, a global base, possibly linearly scaled, for full ones);
- the MLP is gelu_pytorch_tanh gated (GatedMLP with the config's hidden_activation).
Sliding windows come from the config's layer_types (ModelConfig.sliding_windows), as for every family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers import fused
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderAttention, DecoderDims, DecoderOptions, GatedMLP
from tessera.layers.linear import VocabParallelEmbedding
from tessera.layers.rotary import RotaryEmbedding
from tessera.layers.forward_batch import ForwardBatch


GEMMA3_OPTIONS = DecoderOptions(qk_norm=True)
_LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), computed in float32 and cast back to x's dtype at the
    end (transformers' Gemma3RMSNorm; a checkpoint's zero weight is the identity scale).

    unit_offset=False scales by the weight itself (Gemma 4's RMSNorm: a checkpoint's one is the identity)."""

    fused_kind = "gemma"  # see layers/triton_ops.py

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset
        if not unit_offset:
            self.fused_kind = None  # the fused kernels scale by 1 + weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset and fused.active(x) and (
                out := fused.ops().rmsnorm(x, None, self.weight, self.eps, gemma=True)) is not None:
            return out
        scale = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
        return (rms_normalize(x, self.eps) * scale).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in float32 (Gemma's norms without a scale: Gemma 4's v_norm, its router's)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times sqrt(hidden_size), the scale first rounded to the activations' dtype (so bfloat16
    models get transformers' 55.5 for sqrt(3072), not 55.4256; 16-bit tables under float32 activations, on a
    CPU, keep float32's, as transformers does over the upcast weights)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        tp = tp_group()
        super().__init__(vocab_size, hidden_size, tp.rank, tp.size)
        # A float32 buffer, as transformers keeps it, cast to the activations' dtype in forward: a device tensor,
        # so a CUDA graph captures the multiply (a tensor made from the float there would be a host copy).
        scale = float(hidden_size) ** 0.5 if scale is None else scale  # Gemma 4's per-layer table: its own
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float32), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.like.dtype)


class Gemma3Attention(DecoderAttention):
    """The shared paged attention with Gemma's q/k norm and query_pre_attn_scalar as the scale."""

    def __init__(self, cfg: DecoderDims, layer_id: int, attn_backend: BaseAttentionBackend,
                 query_pre_attn_scalar: float):
        super().__init__(cfg, GEMMA3_OPTIONS, layer_id, attn_backend)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scaling = float(query_pre_attn_scalar) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderDims, layer_id: int, attn_backend: BaseAttentionBackend, hidden_act: str,
                 query_pre_attn_scalar: float):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_id, attn_backend, query_pre_attn_scalar)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, hidden_act)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, fb, pool)
        if fused.active(x):  # each norm-add(-norm) sandwich in one kernel (layers/triton_ops.py)
            eps = self.input_layernorm.eps
            done = fused.ops().gemma_norm_add(attn, x, self.post_attention_layernorm.weight,
                                              self.pre_feedforward_layernorm.weight, eps)
            if done is not None:
                h, x = done
                return fused.ops().gemma_norm_add(self.mlp(h), x, self.post_feedforward_layernorm.weight, None,
                                                  eps)[1]
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _rotary(head_dim: int, params: dict[str, Any], layer_type: str) -> RotaryEmbedding:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise NotImplementedError(f"rope_parameters[{layer_type!r}].rope_type={rope_type!r}: Gemma-3 supports "
                                  "default and linear RoPE")
    rotary = RotaryEmbedding(head_dim, float(params["rope_theta"]))
    if rope_type == "linear":  # transformers: inv_freq / factor (positions compressed by the factor)
        rotary.inv_freq /= float(params["factor"])
    return rotary


class Gemma3TextModel(nn.Module):
    """Scaled embedding table, Gemma decoder layers, final norm: `model.*` of our checkpoint names.

    Takes DecoderOptions only to share CausalLM's constructor; Gemma's are fixed (GEMMA3_OPTIONS).
    """

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, attn_backend: BaseAttentionBackend):
        super().__init__()
        text = cfg.hf_config.get_text_config()
        if getattr(text, "attn_logit_softcapping", None):
            raise NotImplementedError("attn_logit_softcapping (Gemma-2 style attention soft-capping) is not supported")
        if getattr(text, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention (all-bidirectional text attention) is not supported")
        layer_types = list(text.layer_types)
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise NotImplementedError(f"layer_types {unknown}: Gemma-3 layers are {list(_LAYER_TYPES)}")
        self.attn_backend = attn_backend
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, attn_backend, cfg.hidden_act, text.query_pre_attn_scalar)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rope = text.rope_parameters
        self.layer_types = layer_types
        self.rotary = nn.ModuleDict({t: _rotary(cfg.head_dim, rope[t], t) for t in _LAYER_TYPES if t in layer_types})

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        """x: input embeddings [T, H] (already scaled); positions [T]. Returns the final-norm hidden states."""
        cos_sin = {t: r.get_cos_sin(positions, x.dtype) for t, r in self.rotary.items()}  # once per forward
        self.attn_backend.init_forward_metadata(fb)
        for layer, layer_type in zip(self.layers, self.layer_types):
            x = layer(x, *cos_sin[layer_type], fb, pool)
        return self.norm(x)
