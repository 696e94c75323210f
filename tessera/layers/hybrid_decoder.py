"""The hybrid decoder of Qwen3-Next and Qwen3.5: `layer_types` says, per layer, "linear_attention" (Gated
DeltaNet, layers/gated_delta.py, its state in the state pool) or "full_attention" (gated softmax attention over the
paged KV). Both kinds are pre-norm blocks with (1 + weight) RMSNorms and a feed-forward (a gated MLP or a MoE).

Full attention, as transformers' Qwen3NextAttention: q_proj yields each head's query and an output gate side by
side; q/k norms; RoPE on the first `partial_rotary_factor` of each head; the attention output times sigmoid(gate)
goes to o_proj. Only the full-attention layers have K/V: the KV pool has one layer per such layer (kv_index).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.cache.state_pool import LinearStateLayout
from tessera.distributed.parallel_state import tp_group
from tessera.layers import gated_delta
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderDims, GatedMLP
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.gemma_decoder import GemmaRMSNorm
from tessera.layers.linear import Linear, MergedLinear, VocabParallelEmbedding
from tessera.layers.rotary import RotaryEmbedding, apply_rotary

LINEAR, FULL = "linear_attention", "full_attention"


def layer_kinds(text) -> tuple[str, ...]:
    kinds = tuple(text.layer_types)
    if len(kinds) != int(text.num_hidden_layers) or set(kinds) - {LINEAR, FULL}:
        raise ValueError(f"layer_types={list(kinds)} must name {text.num_hidden_layers} layers, each "
                         f"{LINEAR!r} or {FULL!r}")
    return kinds


def rotary_dim(cfg: DecoderDims) -> int:
    rope = dict(getattr(cfg.hf_config.get_text_config(), "rope_parameters", None) or {})
    return int(cfg.head_dim * float(rope.get("partial_rotary_factor", 1.0)))


def state_layout(text) -> LinearStateLayout:
    kd, vd = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    hk, hv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    if hv % hk:
        raise ValueError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
    return LinearStateLayout(layer_kinds(text).count(LINEAR), 2 * hk * kd + hv * vd, int(text.linear_conv_kernel_dim),
                             hv, kd, vd)


class GatedRMSNorm(nn.Module):
    """Per value head: RMSNorm(o) * weight * silu(z) (transformers' Qwen3NextRMSNormGated; a plain weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """`linear_attn`: projections, causal conv1d, the gated delta rule over the state pool, gated norm, out_proj.
    `fused_qkvz`: Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped by key head) instead of Qwen3.5's
    in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""

    def __init__(self, cfg: DecoderDims, state_index: int, fused_qkvz: bool):
        super().__init__()
        text = cfg.hf_config.get_text_config()
        lay = state_layout(text)
        self.state_index, self.fused_qkvz = state_index, fused_qkvz
        self.hk, self.hv, self.kd, self.vd = int(text.linear_num_key_heads), lay.num_heads, lay.key_dim, lay.value_dim
        key, value = self.hk * self.kd, self.hv * self.vd
        if fused_qkvz:
            self.in_proj_qkvz = Linear(cfg.hidden_size, 2 * key + 2 * value)
            self.in_proj_ba = Linear(cfg.hidden_size, 2 * self.hv)
        else:
            self.in_proj_qkv = Linear(cfg.hidden_size, 2 * key + value)
            self.in_proj_z = Linear(cfg.hidden_size, value)
            self.in_proj_b = Linear(cfg.hidden_size, self.hv)
            self.in_proj_a = Linear(cfg.hidden_size, self.hv)
        self.conv1d = nn.Conv1d(lay.conv_dim, lay.conv_dim, lay.conv_kernel, groups=lay.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.vd, cfg.rms_norm_eps)
        self.out_proj = Linear(value, cfg.hidden_size)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, conv_dim] laid out [q | k | v], z [T, hv, vd], b, a [T, hv])."""
        t = x.shape[0]
        if not self.fused_qkvz:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.hv, self.vd), self.in_proj_b(x),
                    self.in_proj_a(x))
        r = self.hv // self.hk  # value heads per key head: both projections are grouped by key head
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.hk, -1).split([self.kd, self.kd, r * self.vd, r * self.vd], -1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], -1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.hv, self.vd), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
             weight: torch.Tensor) -> torch.Tensor:
        """One request's consecutive tokens from its state (conv [C, K-1], rec [Hv, Dk, Dv], updated in place)."""
        e, key = qkv.shape[0], self.hk * self.kd
        q, k, v = gated_delta.conv_step(qkv, conv, weight).split([key, key, self.hv * self.vd], -1)
        q, k, v = q.view(e, self.hk, self.kd), k.view(e, self.hk, self.kd), v.view(e, self.hv, self.vd)
        if e == 1:  # a decode row beside prefill chunks: the recurrent step (a chunk would pad to 64)
            return gated_delta.recurrent_rule(q, k, v, g, beta, rec[None])
        return gated_delta.chunked_rule(q, k, v, g, beta, rec)

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: list[int], idx: torch.Tensor,
                conv: torch.Tensor, rec: torch.Tensor, weight: torch.Tensor,
                saves: dict[int, tuple[int, int]]) -> torch.Tensor:
        """One token per row, batched over distinct request rows: a verify step's rows share their request's row,
        so its i-th rows of all requests go together, wave after wave, each from the state the last one left."""
        wave, seen = [], dict.fromkeys(rows, 0)
        for row in rows:
            wave.append(seen[row])
            seen[row] += 1
        waves = [list(range(len(rows)))] if len(seen) == len(rows) else \
            [[i for i, x in enumerate(wave) if x == w] for w in range(max(wave) + 1)]
        key, parts = self.hk * self.kd, []
        for sel in waves:
            pick = slice(None) if len(sel) == len(rows) else sel  # the plain decode step: no gathers
            at = idx[pick]
            conv_s, rec_s = conv.index_select(0, at), rec.index_select(0, at)
            q, k, v = gated_delta.conv_decode(qkv[pick], conv_s, weight).split([key, key, self.hv * self.vd], -1)
            n = len(sel)
            parts.append(gated_delta.recurrent_rule(q.view(n, self.hk, self.kd), k.view(n, self.hk, self.kd),
                                                    v.view(n, self.hv, self.vd), g[pick], beta[pick], rec_s))
            conv.index_copy_(0, at, conv_s)
            rec.index_copy_(0, at, rec_s)
            for i in sel:
                if i in saves:  # the state after this row's token
                    conv[saves[i][1]], rec[saves[i][1]] = conv[rows[i]], rec[rows[i]]
        if len(waves) == 1:
            return parts[0]
        order = torch.tensor([i for sel in waves for i in sel], device=qkv.device)
        return parts[0].new_empty((len(rows), self.hv, self.vd)).index_copy_(0, order, torch.cat(parts))

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        assert pool.state is not None, "a linear-attention layer needs the state pool (cache/state_pool.py)"
        qkv, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv, rec = pool.state.conv[self.state_index], pool.state.recurrent[self.state_index]
        weight = self.conv1d.weight[:, 0]
        ext, _, starts, rows = fb.host_plan()
        saves = {i: (n, slot) for i, n, slot in fb.state_saves}
        if all(e == 1 for e in ext):  # decode (and verify) rows: one token each, batched
            o = self._decode(qkv, g, beta, rows, fb.req_pool_indices, conv, rec, weight, saves)
        else:  # prefill chunks (and any decode rows beside them): row by row, each from its slot's state
            parts = []
            for i, (e, s, row) in enumerate(zip(ext, starts, rows)):
                save = saves.get(i)
                cuts = [0, save[0], e] if save is not None and 0 < save[0] < e else [0, e]
                for lo, hi in zip(cuts, cuts[1:]):
                    parts.append(self._mix(qkv[s + lo:s + hi], g[s + lo:s + hi], beta[s + lo:s + hi], conv[row],
                                           rec[row], weight))
                    if save is not None and save[0] == hi:  # the state after this many of its tokens
                        conv[save[1]], rec[save[1]] = conv[row], rec[row]
            o = torch.cat(parts)
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(x.shape[0], -1))


class GatedAttention(nn.Module):
    """`self_attn` of a full-attention layer (see the module docstring)."""

    def __init__(self, cfg: DecoderDims, kv_index: int, attn_backend: BaseAttentionBackend, bias: bool):
        super().__init__()
        self.layer_id, self.attn_backend = kv_index, attn_backend  # the KV pool's layer; the backend is shared
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": 2 * q, "k": kv, "v": kv}, bias=bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = rotary_dim(cfg)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :d], cos, sin), x[..., d:]], dim=-1) if d < self.head_dim else \
            apply_rotary(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = qg.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q.contiguous()), cos, sin)
        k = self._rotate(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = self.attn_backend.forward(q, k, v, self.layer_id, fb, pool, self.head_dim**-0.5, None)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))


class HybridDecoderLayer(nn.Module):
    fused_qkvz = False  # Qwen3-Next's layers: True

    def __init__(self, cfg: DecoderDims, kind: str, index: int, attn_backend: BaseAttentionBackend,
                 mlp: nn.Module):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, index, self.fused_qkvz)
        else:
            bias = bool(getattr(cfg.hf_config.get_text_config(), "attention_bias", False))
            self.self_attn = GatedAttention(cfg, index, attn_backend, bias)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, fb, pool) if self.kind == LINEAR else self.self_attn(h, cos, sin, fb, pool)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoderModel(nn.Module):
    """`model.*`: embeddings, the hybrid layers, final norm. A family names its layer class and feed-forward."""

    layer_class: type[HybridDecoderLayer] = HybridDecoderLayer

    def __init__(self, cfg: DecoderDims, opts, attn_backend: BaseAttentionBackend):
        super().__init__()
        if tp_group().size != 1:  # the linear-attention heads and the gated q are not sharded yet
            raise NotImplementedError("hybrid linear-attention models (Qwen3-Next, Qwen3.5) do not support tensor "
                                      "parallelism (tp_size > 1) yet")
        self.attn_backend = attn_backend
        kinds = layer_kinds(cfg.hf_config.get_text_config())
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, 0, 1)
        counts = {LINEAR: 0, FULL: 0}
        layers = []
        for i, kind in enumerate(kinds):
            layers.append(self.layer_class(cfg, kind, counts[kind], attn_backend, self.build_mlp(cfg, i)))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.num_full_layers = counts[FULL]
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        section = list(cfg.mrope_section) if cfg.mrope_section else None
        self.rotary_emb = RotaryEmbedding(rotary_dim(cfg), cfg.rope_theta, section, mrope_interleaved=True)

    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                after_layer: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> torch.Tensor:
        cos, sin = self.rotary_emb.get_cos_sin(positions, x.dtype)
        self.attn_backend.init_forward_metadata(fb)
        ext, seq, _, rows = fb.host_plan()
        if pool.state is not None:
            pool.state.copy(fb.state_copies)  # prefix-cache snapshots, then rows starting at token 0 made clean
            fresh = [r for e, s, r in zip(ext, seq, rows) if s == e]
            if fresh:
                pool.state.reset(torch.tensor(fresh, device=pool.state.conv.device))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, fb, pool)
            if after_layer is not None and i in after_layer:
                x = after_layer[i](x)
        return self.norm(x)
