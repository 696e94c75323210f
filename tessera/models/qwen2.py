"""Qwen2 decoder over the paged KV cache (also the language model of Qwen2-VL, with M-RoPE).

Layout follows transformers' Qwen2: q/k/v projections with bias, no o_proj bias, GQA, RMSNorm, SwiGLU MLP,
rotate-half RoPE. q/k/v and gate/up are fused into one matmul each (MergedLinear); the weight loader fills
the shards from the checkpoint's separate tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.activation import SiluAndMul
from tessera.layers.attention import BaseAttentionBackend, get_attention_backend
from tessera.layers.linear import Linear, MergedLinear, VocabEmbedding
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import RotaryEmbedding, apply_rotary
from tessera.models.weights import WeightMapping
from tessera.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class Qwen2LMConfig:
    """The language-model hyperparameters, read from a HF config once and validated."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # None = plain RoPE
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, text_config: Any, tie_word_embeddings: bool, use_mrope: bool) -> Qwen2LMConfig:
        """text_config: a transformers Qwen2Config / Qwen2VLTextConfig."""
        c = text_config
        if getattr(c, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={c.hidden_act!r}: only 'silu' is supported")
        if getattr(c, "use_sliding_window", False):
            raise NotImplementedError("use_sliding_window=True is not supported (all layers use full attention)")
        rope = dict(c.rope_parameters or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"rope_parameters.rope_type={rope_type!r}: only default RoPE is supported")
        num_heads = c.num_attention_heads
        num_kv_heads = c.num_key_value_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        mrope = tuple(rope.get("mrope_section", (16, 24, 24))) if use_mrope else None  # HF's default section
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            mrope_section=mrope,
            tie_word_embeddings=bool(tie_word_embeddings),
        )


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: Qwen2LMConfig, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scaling = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=True)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.attn_backend = attn_backend  # shared by all layers; not a submodule

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = self.attn_backend.forward(q, k, v, self.layer_id, fb, pool, self.scaling)
        return self.o_proj(o)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2LMConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=False)
        self.act = SiluAndMul()
        self.down_proj = Linear(size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2LMConfig, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.self_attn = Qwen2Attention(cfg, layer_id, attn_backend)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
        pool: TokenToKVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the caller adds them (fused into the next norm)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, fb, pool)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen2Model(nn.Module):
    def __init__(self, cfg: Qwen2LMConfig, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.attn_backend = attn_backend
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i, attn_backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mrope = list(cfg.mrope_section) if cfg.mrope_section else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        fb: ForwardBatch,
        pool: TokenToKVPool,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T]; positions [3, T] (M-RoPE) or [T]; input_embeds [T, H] overrides the token
        embedding (the multimodal scatter happens before). Writes each layer's K/V into `pool` at
        fb.out_cache_loc. Returns the final-norm hidden states [T, H]."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary_emb.get_cos_sin(positions, x.dtype)  # once per forward, shared by all layers
        self.attn_backend.init_forward_metadata(fb)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, fb, pool)
        if residual is None:  # zero layers
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 decoder + LM head. forward(fb, pool) -> logits [num_logits, vocab] for fb.logits_indices."""

    def __init__(self, cfg: Qwen2LMConfig, attn_backend: BaseAttentionBackend | None = None):
        super().__init__()
        self.lm_config = cfg
        self.model = Qwen2Model(cfg, attn_backend or get_attention_backend("torch_native"))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_hf_config(
        cls, config: Any, attn_backend: BaseAttentionBackend | None = None, language_model_only: bool = False
    ) -> Qwen2ForCausalLM:
        """config: transformers Qwen2Config. `language_model_only` is accepted for a uniform
        registry interface (a text model has nothing else to skip)."""
        cfg = Qwen2LMConfig.from_hf(config, config.tie_word_embeddings, use_mrope=False)
        return cls(cfg, attn_backend)

    @classmethod
    def weight_mapping(cls, config: Any, language_model_only: bool = False) -> WeightMapping:
        """Checkpoint names -> ours: `model.*` and `lm_head.*` as in transformers' Qwen2ForCausalLM."""
        return WeightMapping(
            prefix_rules=(("model.", "model."), ("lm_head.", None if config.tie_word_embeddings else "lm_head.")),
            stacked=QWEN2_STACKED_PARAMS,
        )

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits for the rows fb.logits_indices of `hidden`; when it is None, for the last new token of
        each request (extend_start_loc + extend_lens - 1), in request order."""
        rows = fb.logits_indices
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_lens - 1
        return self.lm_head(hidden[rows])

    def encode_items(self, items: list, encode: Callable[[list[int]], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Shared part of get_*_feature: one embedding [num_tokens, hidden] per item, in order.

        Items with a precomputed_embedding pass through (cast to the model's dtype/device); the
        indices of the others go to `encode` in ONE call, which returns their embeddings in order.
        Every embedding's row count is checked against the item's placeholder offsets.
        """
        weight = self.model.embed_tokens.weight
        out: list[torch.Tensor | None] = [None] * len(items)
        todo = [i for i, item in enumerate(items) if item.precomputed_embedding is None]
        for i, item in enumerate(items):
            if item.precomputed_embedding is not None:
                out[i] = item.precomputed_embedding.to(device=weight.device, dtype=weight.dtype)
        if todo:
            for i, emb in zip(todo, encode(todo)):
                out[i] = emb
        for i, (item, emb) in enumerate(zip(items, out)):
            assert emb is not None
            if item.offsets and emb.shape[0] != item.num_tokens:
                raise ValueError(
                    f"item {i}: embedding has {emb.shape[0]} rows but its offsets cover {item.num_tokens} tokens"
                )
        return out  # type: ignore[return-value]

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """Token embeddings [T, H] with fb.mm_embeds scattered at the flat rows fb.mm_embed_rows.

        The one scatter routine of every multimodal subclass (images, videos, audio alike): the runner
        has already matched each item's embedding rows to its placeholder offsets."""
        x = self.model.embed_tokens(fb.input_ids)
        if fb.mm_embed_rows is None and fb.mm_embeds is None:
            return x
        if fb.mm_embed_rows is None or fb.mm_embeds is None:
            raise ValueError("mm_embed_rows and mm_embeds must be set together")
        if fb.mm_embed_rows.shape[0] != fb.mm_embeds.shape[0]:
            raise ValueError(
                f"mm_embed_rows has {fb.mm_embed_rows.shape[0]} rows but mm_embeds has {fb.mm_embeds.shape[0]}"
            )
        return x.index_copy_(0, fb.mm_embed_rows, fb.mm_embeds.to(x.dtype))

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """logits [len(fb.logits_indices), vocab] (default: last new token of each request)."""
        x = self.embed(fb) if input_embeds is None else input_embeds
        hidden = self.model(fb.input_ids, fb.positions, fb, pool, x)
        return self.compute_logits(hidden, fb)


# (checkpoint module, our fused module, shard id): HF keeps q/k/v and gate/up as separate tensors.
QWEN2_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", "gate"),
    ("up_proj", "gate_up_proj", "up"),
)
