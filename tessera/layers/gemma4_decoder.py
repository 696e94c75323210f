"""Gemma 4's decoder over the paged KV cache: Gemma-3's block (gemma_decoder.py) with Gemma 4's options.

What differs from Gemma-3, as transformers' Gemma4TextModel does it:
- RMSNorm scales by the weight itself (GemmaRMSNorm(unit_offset=False)); values get a scale-free RMSNorm
  (v_norm); the attention scale is 1 (q and k are RMS-normed), not query_pre_attn_scalar ** -0.5;
- full-attention layers may have their own head_dim and KV heads (per_layer_config: global_head_dim,
  num_global_key_value_heads) and, with attention_k_eq_v, no v_proj (v is k's projection before k_norm);
- RoPE per layer type from rope_parameters ("proportional" for full layers: only a share of the frequencies
  rotate), each computed over that type's head_dim;
- the last num_kv_shared_layers layers compute no K/V: each attends over the K/V of the last earlier layer of
  its type (kv_sharing_modes);
- per-layer embeddings (PLE): a second token table [vocab, layers x P] plus a projection of the input
  embeddings give every layer a P-wide input, gated into the residual after its MLP;
- every layer's output is multiplied by its layer_scalar; shared-KV layers may have a doubled MLP;
- with enable_moe_block, a sparse block (Gemma4Router, Gemma4Experts) beside the dense MLP on the same input.

The KV pool has one shape for all layers (ModelConfig.kv_widest): a layer with fewer KV heads or a narrower
head stores its K/V zero-padded to the widest head and its heads repeated. Zero columns add nothing to
q.k (the scale is 1, independent of head_dim) and give zero output columns, which are dropped. A shared-KV
layer copies its source layer's K/V of the step's tokens into its own pool layer, so every backend, the
prefix cache and the decode paths see ordinary layers (the memory KV sharing saves is not saved yet).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderDims, DecoderOptions, GatedActivation, GatedMLP
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.gemma_decoder import GemmaRMSNorm, ScaledEmbedding, rms_normalize
from tessera.layers.linear import Linear, MergedLinear
from tessera.layers.rotary import RotaryEmbedding, apply_rotary

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _norm(dim: int, eps: float) -> GemmaRMSNorm:
    return GemmaRMSNorm(dim, eps, unit_offset=False)


@dataclasses.dataclass(frozen=True)
class _LayerShape:
    head_dim: int
    num_kv_heads: int
    kv_source: int | None  # the earlier layer whose K/V a shared-KV layer reuses
    k_eq_v: bool


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: DecoderDims, shape: _LayerShape, layer_id: int, attn_backend: BaseAttentionBackend,
                 pool_heads: int, pool_dim: int, bias: bool):
        super().__init__()
        self.layer_id, self.shape = layer_id, shape
        self.num_heads, self.head_dim, self.num_kv_heads = cfg.num_heads, shape.head_dim, shape.num_kv_heads
        if pool_heads % self.num_kv_heads or cfg.num_heads % pool_heads:
            raise ValueError(f"layer {layer_id}: {self.num_kv_heads} KV heads do not tile the pool's {pool_heads} "
                             f"(num_attention_heads={cfg.num_heads})")
        self.kv_repeat, self.pool_dim = pool_heads // self.num_kv_heads, pool_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sizes = {"q": q_size}
        if shape.kv_source is None:
            sizes.update({"k": kv_size} if shape.k_eq_v else {"k": kv_size, "v": kv_size})
            self.k_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_proj = MergedLinear(cfg.hidden_size, sizes, bias=bias)
        self.q_norm = _norm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bias)
        self.eps = cfg.rms_norm_eps
        self.sliding_window = cfg.sliding_windows[layer_id]
        self.attn_backend = attn_backend

    def _to_pool(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] -> the pool's [T, pool heads, pool dim] (heads repeated, dims zero-padded)."""
        if self.kv_repeat > 1:
            x = x.repeat_interleave(self.kv_repeat, dim=1)
        if self.pool_dim != self.head_dim:
            x = nn.functional.pad(x, (0, self.pool_dim - self.head_dim))
        return x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool, backend: BaseAttentionBackend | None = None) -> torch.Tensor:
        n = x.shape[0]
        parts = self.qkv_proj.split(self.qkv_proj(x))
        q = apply_rotary(self.q_norm(parts[0].reshape(n, self.num_heads, self.head_dim)), cos, sin)
        if self.shape.kv_source is not None:
            k_buf, v_buf = pool.get_kv(self.shape.kv_source)
            k = k_buf.index_select(0, fb.out_cache_loc).to(q.dtype)
            v = v_buf.index_select(0, fb.out_cache_loc).to(q.dtype)
        else:
            k = parts[1].reshape(n, self.num_kv_heads, self.head_dim)
            v = parts[2].reshape(n, self.num_kv_heads, self.head_dim) if len(parts) == 3 else k
            v = rms_normalize(v, self.eps).to(v.dtype)
            k = apply_rotary(self.k_norm(k), cos, sin)
            k, v = self._to_pool(k), self._to_pool(v)
        padded = self.pool_dim != self.head_dim
        if padded:
            q = nn.functional.pad(q, (0, self.pool_dim - self.head_dim))
        o = (backend or self.attn_backend).forward(q.contiguous(), k.contiguous(), v.contiguous(), self.layer_id, fb, pool, 1.0,
                                      self.sliding_window)
        if padded:
            o = o.view(n, self.num_heads, self.pool_dim)[..., : self.head_dim].reshape(n, -1)
        return self.o_proj(o)


class Gemma4Router(nn.Module):
    """Gemma 4's MoE router (transformers' Gemma4TextRouter, same parameter names): scores of RMS-normed (no
    weight) x * scale / sqrt(hidden), the softmax's top-k renormalised, times each chosen expert's
    per_expert_scale. forward(x [T, H]) -> (weights [T, k] float32, experts [T, k])."""

    def __init__(self, cfg: DecoderDims, text: Any):
        super().__init__()
        experts, h = int(text.num_experts), cfg.hidden_size
        self.top_k, self.eps, self.root = int(text.top_k_experts), cfg.rms_norm_eps, h ** -0.5
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"top_k_experts={self.top_k} must be between 1 and num_experts={experts}")
        self.proj = Linear(h, experts)
        self.proj.lora_refusal = "LoRA on the MoE router is not supported"  # it changes which experts run
        self.scale = nn.Parameter(torch.empty(h))
        self.per_expert_scale = nn.Parameter(torch.empty(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(rms_normalize(x, self.eps).to(x.dtype) * self.scale * self.root)
        weights, chosen = torch.topk(torch.softmax(scores.float(), dim=-1), self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)) * self.per_expert_scale[chosen], chosen


class Gemma4Experts(nn.Module):
    """E gated MLPs in transformers' stacked layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]); each runs on
    the tokens routed to it only (one gather and two products per expert that has tokens)."""

    def __init__(self, cfg: DecoderDims, text: Any):
        super().__init__()
        experts, inter, h = int(text.num_experts), int(text.moe_intermediate_size), cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(experts, h, inter))
        self.act = GatedActivation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            h = self.act(x[rows] @ self.gate_up_proj[e].t()) @ self.down_proj[e].t()
            out.index_add_(0, rows, (h * weights[rows, slot, None]).to(x.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderDims, text: Any, shape: _LayerShape, layer_id: int,
                 attn_backend: BaseAttentionBackend, pool_heads: int, pool_dim: int):
        super().__init__()
        self.self_attn = Gemma4Attention(cfg, shape, layer_id, attn_backend, pool_heads, pool_dim,
                                         bool(text.attention_bias))
        wide = bool(text.use_double_wide_mlp) and shape.kv_source is not None
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size * (2 if wide else 1), cfg.hidden_act)
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = _norm(h, eps), _norm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = _norm(h, eps), _norm(h, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1))  # a buffer in transformers, saved in checkpoints
        self.moe = bool(text.enable_moe_block)
        if self.moe:  # a sparse block beside the dense MLP: their outputs are normed apart, then summed
            self.router, self.experts = Gemma4Router(cfg, text), Gemma4Experts(cfg, text)
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = _norm(h, eps), _norm(h, eps)
            self.pre_feedforward_layernorm_2 = _norm(h, eps)
        self.per_layer = int(text.hidden_size_per_layer_input or 0)
        if self.per_layer:
            self.per_layer_input_gate = Linear(h, self.per_layer)
            self.per_layer_projection = Linear(self.per_layer, h)
            self.post_per_layer_input_norm = _norm(h, eps)
            self.gated = GatedActivation(cfg.hidden_act)  # act(gate) * per-layer input

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, pool: TokenToKVPool, backend: BaseAttentionBackend | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, fb, pool, backend)
        x = x + self.post_attention_layernorm(attn)
        ff = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            sparse = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(sparse)
        x = x + self.post_feedforward_layernorm(ff)
        if per_layer_input is not None:
            gated = self.gated(torch.cat((self.per_layer_input_gate(x), per_layer_input), dim=-1))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


def _rotary(text: Any, layer_type: str) -> RotaryEmbedding:
    """Our RoPE table with transformers' own inverse frequencies for the layer type (its head_dim, its
    rope_type: default, proportional, linear, ...); a rope_type that rescales cos/sin is refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = text.rope_parameters[layer_type]
    layer_cfg = text.per_layer_config[layer_type]
    head_dim = int(layer_cfg.head_dim)
    rotary = RotaryEmbedding(head_dim, float(params["rope_theta"]))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](layer_cfg, None, layer_type=layer_type)
        if float(scaling) != 1.0:
            raise NotImplementedError(f"rope_parameters[{layer_type!r}].rope_type={rope_type!r} scales cos/sin "
                                      f"by {scaling}: not supported")
        rotary.inv_freq.copy_(inv_freq.float())
    return rotary


def layer_shapes(text: Any) -> list[_LayerShape]:
    """Each layer's head_dim, KV heads, K/V source (shared-KV layers) and k_eq_v, from the config."""
    modes, types = text.kv_sharing_modes, list(text.layer_types)
    out = []
    for i, layer_type in enumerate(types):
        layer_cfg = text.per_layer_config[i]
        source = None
        if modes[i] == "reuse":
            earlier = [j for j in range(i) if types[j] == layer_type and modes[j] != "reuse"]
            if not earlier:
                raise ValueError(f"num_kv_shared_layers={text.num_kv_shared_layers}: layer {i} ({layer_type}) "
                                 "has no earlier layer of its type to share K/V with")
            source = earlier[-1]
        out.append(_LayerShape(int(layer_cfg.head_dim), int(layer_cfg.num_key_value_heads), source,
                               bool(text.attention_k_eq_v) and layer_type == "full_attention"))
    return out


def check_supported(text: Any) -> None:
    """NotImplementedError naming the first config setting this decoder does not run."""
    if text.use_bidirectional_attention == "all":
        raise NotImplementedError("use_bidirectional_attention='all' (all-bidirectional text attention) is not "
                                  "supported")
    unknown = sorted(set(text.layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"layer_types {unknown}: Gemma 4 layers are {list(_LAYER_TYPES)}")
    if tp_group().size > 1:
        raise NotImplementedError("tensor parallelism is not supported for Gemma 4 yet")


class Gemma4TextModel(nn.Module):
    """Scaled embedding table(s), Gemma 4 decoder layers, final norm: `model.*` of our checkpoint names.

    `media_token_ids` (set by the multimodal model): placeholder ids that look up the pad token's row, in the
    main table and the per-layer one, as transformers does before the media rows are merged."""

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, attn_backend: BaseAttentionBackend):
        super().__init__()
        text = cfg.hf_config.get_text_config()
        check_supported(text)
        self.attn_backend = attn_backend
        self.bidirectional = text.use_bidirectional_attention == "vision"
        # Full layers stay causal where sliding ones see media spans both ways: their own backend instance, as a
        # backend's per-step state belongs to one ForwardBatch (as llama4_decoder's chunked layers do).
        self.full_backend = type(attn_backend)() if self.bidirectional else None
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        pool = cfg.kv_widest or (cfg.num_kv_heads, cfg.head_dim)
        shapes = layer_shapes(text)
        self.layer_types = list(text.layer_types)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, text, s, i, attn_backend, *pool) for i, s in enumerate(shapes))
        self.norm = _norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = nn.ModuleDict({t: _rotary(text, t) for t in _LAYER_TYPES if t in self.layer_types})
        self.pad_token_id = int(text.pad_token_id or 0)
        self.register_buffer("media_token_ids", torch.empty(0, dtype=torch.long), persistent=False)
        self.per_layer = int(text.hidden_size_per_layer_input or 0)
        if self.per_layer:
            width = cfg.num_layers * self.per_layer
            self.embed_tokens_per_layer = ScaledEmbedding(int(text.vocab_size_per_layer_input), width,
                                                          scale=self.per_layer ** 0.5)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width)
            self.per_layer_projection_norm = _norm(self.per_layer, cfg.rms_norm_eps)
            self.projection_scale = cfg.hidden_size ** -0.5

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.media_token_ids.numel():
            return input_ids
        return input_ids.masked_fill(torch.isin(input_ids, self.media_token_ids), self.pad_token_id)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: (norm(projection of the merged embeddings) + the token's per-layer row) / sqrt(2)."""
        n, layers = x.shape[0], len(self.layers)
        projected = self.per_layer_model_projection(x) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(n, layers, self.per_layer))
        own = self.embed_tokens_per_layer(self.text_ids(input_ids)).reshape(n, layers, self.per_layer)
        return (projected + own) * 2.0 ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        """x: input embeddings [T, H] (already scaled, media merged); positions [T]. Returns the final-norm
        hidden states. Media spans attend bidirectionally only in sliding layers (transformers'
        create_masks_for_vision_model), and only when use_bidirectional_attention is "vision"."""
        cos_sin = {t: r.get_cos_sin(positions, x.dtype) for t, r in self.rotary.items()}
        per_layer = self.per_layer_inputs(fb.input_ids, x) if self.per_layer else None
        masked = fb.custom_masks is not None and any(m is not None for m in fb.custom_masks)
        sliding_fb = full_fb = fb if not masked else dataclasses.replace(fb, custom_masks=None)
        if masked and self.full_backend is not None:
            # Two backends in one step: neither keeps its decode mirror (llama4_decoder does the same).
            full_fb = dataclasses.replace(fb, custom_masks=None, req_generations=None)
            sliding_fb = dataclasses.replace(fb, req_generations=None)
            self.full_backend.init_forward_metadata(full_fb)
        self.attn_backend.init_forward_metadata(sliding_fb)
        for i, (layer, layer_type) in enumerate(zip(self.layers, self.layer_types)):
            full = layer_type == "full_attention" and full_fb is not sliding_fb
            x = layer(x, None if per_layer is None else per_layer[:, i], *cos_sin[layer_type],
                      full_fb if full else sliding_fb, pool, self.full_backend if full else None)
        return self.norm(x)
