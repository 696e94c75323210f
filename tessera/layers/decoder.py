"""Decoder building blocks over the paged KV cache: attention, gated MLP, pre-norm layer, decoder stack.

A decoder-only language model is these blocks plus a few options (DecoderOptions) read by its family's
model file. Parameter names follow transformers' Llama/Qwen2 layout (`layers.N.self_attn.qkv_proj`,
`mlp.gate_up_proj`, `input_layernorm`, ...), with q/k/v and gate/up fused into one matmul each; the weight
loader fills the shards from the checkpoint's separate tensors (STACKED_PARAMS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers import decode_stack, fused
from tessera.layers.activation import SiluAndMul
from tessera.layers.attention import BaseAttentionBackend
from tessera.distributed.parallel_state import tp_group
from tessera.layers.linear import Linear, MergedLinear, RowParallelLinear, VocabParallelEmbedding
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import RotaryEmbedding, apply_rotary
from tessera.layers.forward_batch import ForwardBatch



@dataclass(frozen=True)
class DecoderDims:
    """The sizes and settings the shared blocks read: the layers need nothing else of the model.
    models/config.py's ModelConfig extends it with what the rest of the engine reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_type: str  # rope_parameters.rope_type ("default", "mrope", ...)
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # set when the family's position scheme is "mrope"
    # Per layer: the sliding window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    hf_config: Any  # the transformers config, for encoders, processors and what a family's blocks read

# (checkpoint module, our fused module, shard id): checkpoints keep q/k/v and gate/up as separate tensors.
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", "gate"),
    ("up_proj", "gate_up_proj", "up"),
)
# UngatedMLP's fc1 is a one-shard fused module (its TP rows load as the others' do); only for decoder names.
UNGATED_STACKED_PARAMS = STACKED_PARAMS + (("fc1", "fc1", "fc1"),)


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between decoder families that share this layout."""

    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma-3)
    ungated_mlp: bool = False  # fc2(act(fc1(x))) instead of SwiGLU (Cosmos3 Edge's relu2 MLP)
    # GLM-4: RoPE on the first head_dim * partial_rotary_factor dims only, rotating adjacent pairs (2i, 2i+1)
    # rather than halves, and an RMSNorm on the attention output and on the MLP output before each residual add
    # (post_self_attn_layernorm, post_mlp_layernorm).
    partial_rotary_factor: float = 1.0
    rotary_pairs: bool = False
    post_block_norms: bool = False

    @property
    def plain_rotary(self) -> bool:
        """Whether RoPE is the common full-head rotate-half one (what the fused kernels implement)."""
        return self.partial_rotary_factor == 1.0 and not self.rotary_pairs


class GatedActivation(nn.Module):
    """[..., 2d] laid out [gate | up] -> act(gate) * up."""

    def __init__(self, act: str):
        super().__init__()
        if act not in ("silu", "gelu_tanh", "gelu_pytorch_tanh"):
            raise NotImplementedError(f"hidden_act={act!r}: gated MLPs support silu and gelu_pytorch_tanh")
        self.act = act
        self._silu = SiluAndMul() if act == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._silu is not None:
            return self._silu(x)
        if fused.active(x) and (out := fused.ops().gelu_tanh_and_mul(x)) is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        hd = cfg.head_dim
        # Tensor parallel: each rank keeps its share of the query heads and of the KV heads (one replicated
        # KV head per rank when there are fewer KV heads than ranks); with one rank this is every head.
        tp = tp_group()
        q_start, self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        if cfg.num_kv_heads >= tp.size:
            kv_start, self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        elif tp.size % cfg.num_kv_heads == 0:
            kv_start, self.num_kv_heads = tp.rank * cfg.num_kv_heads // tp.size, 1
        else:
            raise ValueError(f"num_key_value_heads={cfg.num_kv_heads} neither splits over nor divides "
                             f"tp_size={tp.size}")
        self.head_dim = hd
        self.scaling = hd**-0.5
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        sources = None if tp.size == 1 else {"q": (q_start * hd, cfg.num_heads * hd),
                                             "k": (kv_start * hd, cfg.num_kv_heads * hd),
                                             "v": (kv_start * hd, cfg.num_kv_heads * hd)}
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=opts.qkv_bias,
                                     sources=sources)
        self.o_proj = (Linear(q_size, cfg.hidden_size, bias=opts.o_bias) if tp.size == 1 else
                       RowParallelLinear(q_size, cfg.hidden_size, opts.o_bias, q_start * hd, cfg.num_heads * hd))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.sliding_window = cfg.sliding_windows[layer_id]
        self.plain_rotary, self.rotary_pairs = opts.plain_rotary, opts.rotary_pairs
        self.attn_backend = attn_backend  # shared by all layers; not a submodule

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: TokenToKVPool) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        norm_kind = getattr(self.q_norm, "fused_kind", None)  # "rms" (Qwen3), "gemma"; None: no q/k norm
        if (self.attn_backend.reads_new_kv_from_pool and fused.active(qkv) and self.plain_rotary
                and (self.q_norm is None or norm_kind is not None)):
            # One kernel (q/k norms,) rotates q and k and writes k and v into the pool (the backend then only
            # reads it).
            k_buf, v_buf = pool.get_kv(self.layer_id)
            qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                                        norm_kind == "gemma")
            q = fused.ops().rotary_store_kv(qkv, cos, sin, k_buf, v_buf, fb.out_cache_loc, self.num_heads,
                                            self.num_kv_heads, self.head_dim, qk_norm)
            if q is not None:
                o = self.attn_backend.forward(q, None, None, self.layer_id, fb, pool, self.scaling,
                                              self.sliding_window)
                return self.o_proj(o)
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent columns of the fused projection: one rotary pass over both heads' sets
            # (half the elementwise kernels of rotating them apart; a decode step is bound by such small ops).
            qk_heads = self.num_heads + self.num_kv_heads
            qk = apply_rotary(qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim), cos, sin,
                              self.rotary_pairs)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = self.qkv_proj.split(qkv)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin, self.rotary_pairs), apply_rotary(k, cos, sin, self.rotary_pairs)
            v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        o = self.attn_backend.forward(q, k, v, self.layer_id, fb, pool, self.scaling, self.sliding_window)
        return self.o_proj(o)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        tp = tp_group()
        start, size = tp.shard(intermediate_size, "intermediate_size")  # column- then row-parallel
        sources = None if tp.size == 1 else {"gate": (start, intermediate_size), "up": (start, intermediate_size)}
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": size, "up": size}, sources=sources)
        self.act = GatedActivation(act)
        self.down_proj = (Linear(size, hidden_size) if tp.size == 1 else
                          RowParallelLinear(size, hidden_size, False, start, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class UngatedMLP(nn.Module):
    """fc2(act(fc1(x))) with transformers' names (Cosmos3 Edge: act = relu2, i.e. relu(x)**2; no biases)."""

    # fc1's output is a fresh tensor: relu2 squares it in place (no [tokens, intermediate] temporary).
    ACTIVATIONS = {"relu2": lambda h: F.relu_(h).square_(), "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
                   "silu": F.silu}

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        if act not in self.ACTIVATIONS:
            raise NotImplementedError(f"hidden_act={act!r}: ungated MLPs support {', '.join(self.ACTIVATIONS)}")
        tp = tp_group()
        start, size = tp.shard(intermediate_size, "intermediate_size")  # column- then row-parallel
        # One shard named as the checkpoint's module, so that a TP rank loads its rows as the fused modules do.
        self.fc1 = MergedLinear(hidden_size, {"fc1": size},
                                sources=None if tp.size == 1 else {"fc1": (start, intermediate_size)})
        self.act = self.ACTIVATIONS[act]
        self.fc2 = (Linear(size, hidden_size) if tp.size == 1 else
                    RowParallelLinear(size, hidden_size, False, start, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into the norms.
    With post_block_norms (GLM-4): x + post_norm(attn(norm(x))), then + post_norm(mlp(norm(.)))."""

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.opts = opts
        self.self_attn = DecoderAttention(cfg, opts, layer_id, attn_backend)
        self.mlp = self.build_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        post = opts.post_block_norms
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post else None
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post else None

    def build_mlp(self, cfg: DecoderDims, layer_id: int) -> nn.Module:
        """The feed-forward: [T, H] -> [T, H]; a family whose layers differ there (a mixture of experts) overrides it."""
        mlp = UngatedMLP if self.opts.ungated_mlp else GatedMLP
        return mlp(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                fb: ForwardBatch, pool: TokenToKVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the caller adds them (fused into the next norm)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, fb, pool)
        if self.post_self_attn_layernorm is not None:
            x = self.post_self_attn_layernorm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            x = self.post_mlp_layernorm(x)
        return x, residual


class DecoderModel(nn.Module):
    """Embedding table, decoder layers and final norm: `model.*` in the checkpoint."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: DecoderDims, opts: DecoderOptions, attn_backend: BaseAttentionBackend):
        super().__init__()
        if cfg.rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"rope_parameters.rope_type={cfg.rope_type!r}: only default RoPE is supported")
        self.attn_backend = attn_backend
        tp = tp_group()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(self.layer_class(cfg, opts, i, attn_backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mrope = list(cfg.mrope_section) if cfg.mrope_section else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, mrope,
                                          rotary_dim=int(cfg.head_dim * opts.partial_rotary_factor))

    def plain_blocks(self) -> bool:
        """Whether every layer is this file's own block with SwiGLU (not a family's subclass): what the decode
        stack's C driver runs (layers/decode_stack.py)."""
        plain = self.__dict__.get("_plain_blocks")
        if plain is None:
            plain = all(type(layer) is DecoderLayer and type(layer.self_attn) is DecoderAttention
                        and type(layer.mlp) is GatedMLP and layer.mlp.act.act == "silu"
                        and layer.self_attn.plain_rotary and layer.post_mlp_layernorm is None for layer in self.layers)
            self.__dict__["_plain_blocks"] = plain
        return plain

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool,
                after_layer: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> torch.Tensor:
        """x: input embeddings [T, H]; positions [T] or [3, T]. Returns the final-norm hidden states [T, H].

        after_layer[i] (optional) rewrites layer i's output hidden states (Qwen3-VL's DeepStack adds
        visual features there); those layers' residual sums are materialised for it.
        """
        cos, sin = self.rotary_emb.get_cos_sin(positions, x.dtype)  # once per forward, shared by all layers
        self.attn_backend.init_forward_metadata(fb)
        if not after_layer and self.plain_blocks():
            hidden = decode_stack.run(self, x, cos, sin, fb, pool)  # the whole step in one C call, where it applies
            if hidden is not None:
                return hidden
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, fb, pool)
            if after_layer is not None and i in after_layer:
                x, residual = after_layer[i](x + residual), None
        if residual is None:  # zero layers
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x
