"""Llama-4's text decoder over the paged KV cache: the shared attention and gated MLP with Llama-4's differences.

What differs from the shared pre-norm block (layers/decoder.py), as transformers' Llama4TextModel does it:
- RoPE layers and NoPE layers (`no_rope_layers[i]` is 1 on a RoPE layer, 0 on a NoPE one). RoPE is the complex
  form: (x[2i], x[2i+1]) is rotated by frequency i (interleaved pairs, not rotate-half), in float32.
- On RoPE layers with `use_qk_norm`, q and k are L2-normalised per head after RoPE (an RMS norm without weight).
- On NoPE layers with `attn_temperature_tuning`, q is scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
  for a query at absolute position p.
- With `attention_chunk_size` C, the "chunked_attention" layers of `layer_types` (by default the RoPE layers) are
  local: a query at position p sees only keys k <= p with k // C == p // C; the others (by default the NoPE
  layers) attend to everything before them.
- The feed-forward is a mixture of experts on `moe_layers` (layers/moe.py) and a dense gated MLP of
  `intermediate_size_mlp` elsewhere.

Chunked attention is expressed as per-request custom masks (the attention-backend contract's `custom_masks`, so
it holds on every backend): the chunked layers run on their own backend instance, whose ForwardBatch carries the
chunk masks, built once per step from the absolute positions of the step's queries. That holds for chunked
prefill and decode alike, whatever the step boundaries and wherever chunk boundaries fall; a request whose
whole sequence lies in the first chunk keeps the plain causal path (no mask). Both backends get the step's
ForwardBatch without request generations, so neither keeps a decode K/V mirror (each serves only part of the
layers, which that cache does not allow).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderAttention, DecoderDims, DecoderOptions, GatedMLP
from tessera.layers.linear import VocabParallelEmbedding
from tessera.layers.moe import SigmoidTopKMoE
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import rope_inv_freq
from tessera.layers.forward_batch import ForwardBatch



@dataclasses.dataclass(frozen=True)
class Llama4TextSettings:
    """What Llama-4's text config says beyond ModelConfig, read once (per layer where it varies)."""

    use_rope: tuple[bool, ...]
    is_chunked_layer: tuple[bool, ...]  # layer_types[i] == "chunked_attention" (and a chunk size is set)
    is_moe: tuple[bool, ...]
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    attention_bias: bool
    intermediate_size_mlp: int
    num_experts: int
    top_k: int

    @classmethod
    def from_text_config(cls, text: Any) -> Llama4TextSettings:
        n = int(text.num_hidden_layers)
        no_rope = list(text.no_rope_layers)
        if len(no_rope) < n:
            raise ValueError(f"no_rope_layers has {len(no_rope)} entries for num_hidden_layers={n}")
        moe_layers = {int(i) for i in text.moe_layers}
        chunk = getattr(text, "attention_chunk_size", None)
        # transformers picks each layer's mask by layer_types (derived from no_rope_layers and the chunk size
        # when the config does not list them).
        layer_types = list(getattr(text, "layer_types", None) or
                           ["chunked_attention" if no_rope[i] and chunk else "full_attention" for i in range(n)])
        unknown = set(layer_types) - {"chunked_attention", "full_attention"}
        if unknown or len(layer_types) < n:
            raise ValueError(f"layer_types={layer_types}: expected {n} of chunked_attention / full_attention")
        if chunk is None and "chunked_attention" in layer_types:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set")
        return cls(
            use_rope=tuple(bool(no_rope[i]) for i in range(n)),
            is_chunked_layer=tuple(layer_types[i] == "chunked_attention" for i in range(n)),
            is_moe=tuple(i in moe_layers for i in range(n)),
            attention_chunk_size=int(chunk) if chunk else None,
            use_qk_norm=bool(text.use_qk_norm),
            attn_temperature_tuning=bool(text.attn_temperature_tuning),
            floor_scale=float(text.floor_scale),
            attn_scale=float(text.attn_scale),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            intermediate_size_mlp=int(text.intermediate_size_mlp),
            num_experts=int(text.num_local_experts),
            top_k=int(text.num_experts_per_tok),
        )

    def is_chunked(self, layer_id: int) -> bool:
        return self.attention_chunk_size is not None and self.is_chunked_layer[layer_id]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D // 2] float32 -> x with each pair (x[2i], x[2i+1]) rotated by angle i
    (transformers' Llama-4 apply_rotary_emb: a complex multiply in float32), cast back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32 (Llama4TextL2Norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def chunk_masks(fb: ForwardBatch, chunk: int) -> list[torch.Tensor | None] | None:
    """Per request: bool [extend_len, seq_len], query at p sees keys k <= p with k // chunk == p // chunk
    (ANDed with the request's own custom mask, if any); None where the sequence lies in the first chunk
    (plain causal). None when no request needs a mask."""
    ext_lens, seq_lens, _, _ = fb.host_plan()
    own = fb.custom_masks or [None] * len(seq_lens)
    device = fb.req_to_token.device
    masks: list[torch.Tensor | None] = []
    for ext, seq, base in zip(ext_lens, seq_lens, own):
        if seq <= chunk or ext == 0:
            masks.append(base)
            continue
        q = torch.arange(seq - ext, seq, device=device)[:, None]
        k = torch.arange(seq, device=device)[None, :]
        mask = (k <= q) & (k // chunk == q // chunk)
        masks.append(mask if base is None else mask & base.to(device=device, dtype=torch.bool))
    return masks if any(m is not None for m in masks) else None


class Llama4Attention(DecoderAttention):
    """The shared q/k/v/o projections; RoPE or NoPE, qk L2 norm and temperature tuning as the layer says."""

    def __init__(self, cfg: DecoderDims, settings: Llama4TextSettings, layer_id: int,
                 attn_backend: BaseAttentionBackend):
        opts = DecoderOptions(qkv_bias=settings.attention_bias, o_bias=settings.attention_bias)
        super().__init__(cfg, opts, layer_id, attn_backend)
        self.use_rope = settings.use_rope[layer_id]
        self.use_qk_norm = settings.use_qk_norm and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.temperature = None if self.use_rope or not settings.attn_temperature_tuning else \
            (settings.floor_scale, settings.attn_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,  # type: ignore[override]
                pool: TokenToKVPool, positions: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
        if self.use_qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            assert positions is not None, "temperature tuning needs the tokens' positions"
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        o = self.attn_backend.forward(q, k, v, self.layer_id, fb, pool, self.scaling, None)
        return self.o_proj(o)


class Llama4DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + feed_forward(norm(.)) (MoE or dense)."""

    def __init__(self, cfg: DecoderDims, settings: Llama4TextSettings, layer_id: int,
                 attn_backend: BaseAttentionBackend):
        super().__init__()
        self.self_attn = Llama4Attention(cfg, settings, layer_id, attn_backend)
        self.feed_forward: nn.Module
        if settings.is_moe[layer_id]:
            self.feed_forward = SigmoidTopKMoE(cfg.hidden_size, cfg.intermediate_size, settings.num_experts,
                                               settings.top_k, cfg.hidden_act)
        else:
            self.feed_forward = GatedMLP(cfg.hidden_size, settings.intermediate_size_mlp, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, pool: TokenToKVPool, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, fb, pool, positions)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual


class Llama4RotaryEmbedding(nn.Module):
    """Angles position * inv_freq in float32 (cos/sin [T, head_dim // 2]); inv_freq from transformers' RoPE
    initialisers for scaled RoPE types (llama3, ...), theta^(-2i/d) for "default"."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: DecoderDims):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(cfg.rope_type, cfg.rope_theta, cfg.head_dim,
                                                         cfg.hf_config.get_text_config())
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


class Llama4DecoderModel(nn.Module):
    """Embedding table, decoder layers and final norm: `model.*` (transformers' Llama4TextModel)."""

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.settings = Llama4TextSettings.from_text_config(cfg.hf_config.get_text_config())
        self.attn_backend = attn_backend
        # The chunked layers' own backend instance: its per-step state belongs to the masked ForwardBatch.
        self.chunk_backend = type(attn_backend)() if any(
            self.settings.is_chunked(i) for i in range(cfg.num_layers)) else None
        tp = tp_group()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(cfg, self.settings, i, self.chunk_backend if self.settings.is_chunked(i) and
                               self.chunk_backend is not None else attn_backend)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Llama4RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                **_: Any) -> torch.Tensor:
        """x: input embeddings [T, H]; positions [T] (absolute token indices). Returns the final-norm hidden
        states [T, H]."""
        pos = positions[0] if positions.dim() == 2 else positions
        cos, sin = self.rotary_emb.get_cos_sin(pos)
        full_fb = dataclasses.replace(fb, req_generations=None)
        self.attn_backend.init_forward_metadata(full_fb)
        chunk_fb = full_fb
        if self.chunk_backend is not None:
            assert self.settings.attention_chunk_size is not None
            chunk_fb = dataclasses.replace(full_fb, custom_masks=chunk_masks(fb, self.settings.attention_chunk_size))
            self.chunk_backend.init_forward_metadata(chunk_fb)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            layer_fb = chunk_fb if self.settings.is_chunked(i) else full_fb
            x, residual = layer(x, residual, cos, sin, layer_fb, pool, pos)
        if residual is None:
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x
