"""Multi-head latent attention (DeepSeek-V2/V3's MLA, Kimi-K2's text model) over the paged KV pool.

transformers' DeepseekV3Attention, token for token:
- q: q_b_proj(RMSNorm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None), per head [qk_nope | qk_rope];
- the latent: kv_a_proj_with_mqa(x) = [kv_lora_rank | qk_rope]; the first part RMS-normed and decompressed by
  kv_b_proj into per-head [k_nope | v], the second the rotary key part every head shares;
- RoPE on the rope parts only. `rope_interleave` (DeepSeek's layout): the rope dims are pairs (x0, x1), (x2, x3),
  ... rotated by one frequency each; transformers de-interleaves them (evens, then odds) and rotates the halves,
  which is what we do, with q and k permuted alike (the scores are the same as rotating in place);
- softmax scale (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled RoPE (YaRN),
  and cos/sin times the RoPE's own attention factor (transformers' `attention_scaling`).

The pool holds the decompressed per-head K (qk_nope + qk_rope wide) and V (v_head_dim wide, zero-padded to K's
width) of every token: the shared pool, every attention backend, the CPU decode kernel and the decode K/V mirror
take one head width for K and V, and zeros in V only add zero columns to the output (sliced off before o_proj),
so MLA needs no new pool layout or kernels. What it costs is memory: num_heads x (qk_head + qk_head) values per
token and layer, where the latent form SGLang uses keeps kv_lora_rank + qk_rope (576 for DeepSeek-V3, against
128 x 384 here): the next step is a latent pool with absorbed kv_b_proj weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import Linear, MergedLinear
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import apply_rotary

# (checkpoint module, our fused module, shard id): the two projections of x, the query's and the latent's, are one
# matmul (SGLang's fused_qkv_a_proj_with_mqa).
MLA_STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("q_a_proj", "qkv_a_proj", "q"),
    ("q_proj", "qkv_a_proj", "q"),
    ("kv_a_proj_with_mqa", "qkv_a_proj", "kv"),
)


def mla_head_dim(text: Any) -> int:
    """The pool's per-head width for an MLA text config: K's qk_nope + qk_rope, or v_head_dim if wider."""
    return max(int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim), int(text.v_head_dim))


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(text: Any) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under any scaled RoPE that sets
    mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = (int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim)) ** -0.5
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


class ScaledRotaryEmbedding(nn.Module):
    """cos/sin [T, rope_dim // 2] of the rope dims: inverse frequencies and attention factor from transformers' own
    RoPE initialisers (yarn, linear, llama3, ...) for a scaled RoPE, theta^(-2i/d) for "default"; angles in float32,
    times the factor, cast to the activations' dtype as transformers does."""

    inv_freq: torch.Tensor

    def __init__(self, text: Any, rope_dim: int):
        super().__init__()
        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        self.attention_scaling = 1.0
        if rope_type == "default":
            theta = float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
            inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
                raise NotImplementedError(f"rope_parameters.rope_type={rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, None)
            self.attention_scaling = float(scaling)
        if inv_freq.numel() != rope_dim // 2:
            raise ValueError(f"rope_parameters give {inv_freq.numel()} frequencies for qk_rope_head_dim={rope_dim}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions[0] if positions.dim() == 2 else positions
        freqs = pos.float()[:, None] * self.inv_freq
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


class MLAttention(nn.Module):
    """forward(x [T, hidden], cos, sin, fb, pool) -> [T, hidden]; see the module docstring."""

    def __init__(self, text: Any, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        if tp_group().size != 1:
            raise NotImplementedError("multi-head latent attention does not support tensor parallelism (tp_size > 1)")
        self.layer_id = layer_id
        hidden = int(text.hidden_size)
        self.num_heads = int(text.num_attention_heads)
        self.num_kv_heads = self.num_heads  # decompressed K/V: one per query head (CausalLM.kv_layout reads it)
        self.nope, self.rope = int(text.qk_nope_head_dim), int(text.qk_rope_head_dim)
        self.v_dim, self.kv_rank = int(text.v_head_dim), int(text.kv_lora_rank)
        self.qk_dim = self.nope + self.rope
        self.head_dim = mla_head_dim(text)  # the pool's
        self.interleaved = bool(getattr(text, "rope_interleave", True))
        q_rank = getattr(text, "q_lora_rank", None)
        bias = bool(getattr(text, "attention_bias", False))
        q_out = int(q_rank) if q_rank is not None else self.num_heads * self.qk_dim
        if q_rank is None and bias:  # q_proj has no bias where kv_a_proj_with_mqa has one: not one fused matmul
            raise NotImplementedError("attention_bias without q_lora_rank is not supported")
        self.qkv_a_proj = MergedLinear(hidden, {"q": q_out, "kv": self.kv_rank + self.rope}, bias=bias)
        # transformers builds both latent norms with its default eps (1e-6), not the config's rms_norm_eps
        self.q_a_layernorm = RMSNorm(int(q_rank), 1e-6) if q_rank is not None else None
        self.q_b_proj = Linear(int(q_rank), self.num_heads * self.qk_dim) if q_rank is not None else None
        self.kv_a_layernorm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_rank, self.num_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scaling = mla_softmax_scale(text)
        self.attn_backend = attn_backend  # shared by all layers; not a submodule

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # (x0, x1), (x2, x3), ... -> evens then odds, rotated as halves
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x.contiguous(), cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q_part, latent = self.qkv_a_proj.split(self.qkv_a_proj(x))
        if self.q_b_proj is not None:
            q_part = self.q_b_proj(self.q_a_layernorm(q_part.contiguous()))
        q = q_part.reshape(t, h, self.qk_dim)
        kv_nope, k_rot = latent.split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_nope.contiguous())).view(t, h, self.nope + self.v_dim)
        q_rot = self._rotate(q[..., self.nope:], cos, sin)
        k_rot = self._rotate(k_rot.reshape(t, 1, self.rope), cos, sin)
        d = self.head_dim
        q_full = q.new_zeros(t, h, d)
        q_full[..., :self.nope] = q[..., :self.nope]
        q_full[..., self.nope:self.qk_dim] = q_rot
        k = q.new_zeros(t, h, d)
        k[..., :self.nope] = kv[..., :self.nope]
        k[..., self.nope:self.qk_dim] = k_rot
        v = kv[..., self.nope:]
        if self.v_dim < d:
            v = F.pad(v, (0, d - self.v_dim))
        o = self.attn_backend.forward(q_full, k, v.contiguous(), self.layer_id, fb, pool, self.scaling)
        o = o.view(t, h, d)[..., :self.v_dim].reshape(t, h * self.v_dim)
        return self.o_proj(o)
