"""Whisper: transformers' audio encoder + our decoder, which cross-attends to each request's encoder output.

The decoder is ours: learned absolute positions, pre-LayerNorm layers of causal self-attention over the paged
KV pool (the attention backend, as every decoder), cross-attention, and a GELU MLP; logits through the
embedding matrix (tied, as transformers ties `proj_out`) or proj_out when untied.

Cross-attention K/V live in the same paged KV pool as the self-attention K/V (same heads, same head size,
one entry per decoder layer): a request owns `cross_attention_len` pool slots for them (the encoder output
length, max_source_positions), declared as the family's RequestState (WhisperCrossKV, models/request_state.py):
filled once by `fill_cross_kv` from its encoder output when it is admitted and freed with its other KV (finish,
abort, retraction). So they are counted by the same allocator that admission control budgets against. Each
step, the decoder reads them at `fb.state_slots` ([B, cross_attention_len]).

The encoder is transformers' `WhisperEncoder`: it takes exactly 2 * max_source_positions mel frames (the feature
extractor's padded window) and has no padding mask, as in transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.linear import Linear, linear
from tessera.models.base import Encoder, TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.mm_embed import item_embeddings
from tessera.models.request_state import RequestState
from tessera.models.weights import WeightMapping
from tessera.models.whisper_decoding import WhisperTokens
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.layers.forward_batch import ForwardBatch
from tessera.messages.worker import SamplingRow

ENCODER = "transformers.models.whisper.modeling_whisper:WhisperEncoder"
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class WhisperAttentionProjections(nn.Module):
    """q/k/v/out projections named as transformers names them (k_proj has no bias)."""

    def __init__(self, dim: int):
        super().__init__()
        self.q_proj = Linear(dim, dim, bias=True)
        self.k_proj = Linear(dim, dim, bias=False)
        self.v_proj = Linear(dim, dim, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: BaseAttentionBackend):
        super().__init__()
        dim = config.hidden_size
        self.layer_id = layer_id
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.attn_backend = attn_backend
        self.self_attn = WhisperAttentionProjections(dim)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = WhisperAttentionProjections(dim)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = Linear(dim, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, dim, bias=True)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        t = x.shape[0]
        h = self.self_attn_layer_norm(x)
        # transformers scales q before the product (then attends with scale 1): the same order here.
        q = (self.self_attn.q_proj(h) * self.scaling).view(t, self.num_heads, self.head_dim)
        k = self.self_attn.k_proj(h).view(t, self.num_heads, self.head_dim)
        v = self.self_attn.v_proj(h).view(t, self.num_heads, self.head_dim)
        x = x + self.self_attn.out_proj(self.attn_backend.forward(q, k, v, self.layer_id, fb, pool, 1.0))
        h = self.encoder_attn_layer_norm(x)
        x = x + self.encoder_attn.out_proj(self._cross_attention(h, fb, pool))
        h = self.final_layer_norm(x)
        return x + self.fc2(self.act(self.fc1(h)))

    def _cross_attention(self, h: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        """Each request's new tokens attend to all of its cross K/V (no mask: the encoder output is whole)."""
        assert fb.state_slots is not None, "an encoder-decoder step needs each request's cross-attention slots"
        t = h.shape[0]
        q = (self.encoder_attn.q_proj(h) * self.scaling).view(t, self.num_heads, self.head_dim)
        k, v = pool.gather(self.layer_id, fb.state_slots, dtype=q.dtype)  # [B, L, H, D] each
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        ext, _, starts, _ = fb.host_plan()
        if all(n == 1 for n in ext):  # decode: one query per request, one batched call
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=1.0)  # [B, H, 1, D]
            return out.reshape(t, -1)
        out = torch.empty_like(q)
        for i, (start, n) in enumerate(zip(starts, ext)):
            if n:
                qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                oi = F.scaled_dot_product_attention(qi, k[i:i + 1], v[i:i + 1], scale=1.0)
                out[start:start + n] = oi[0].transpose(0, 1)
        return out.reshape(t, -1)

    def fill_cross_kv(self, encoder_out: torch.Tensor, slots: torch.Tensor, pool: TokenToKVPool) -> None:
        """encoder_out [n, L, d] -> this layer's cross K/V written at slots [n, L]."""
        n, length, _ = encoder_out.shape
        k = self.encoder_attn.k_proj(encoder_out).view(n * length, self.num_heads, self.head_dim)
        v = self.encoder_attn.v_proj(encoder_out).view(n * length, self.num_heads, self.head_dim)
        pool.set_kv(self.layer_id, slots.reshape(-1), k, v)


class WhisperDecoder(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, i, attn_backend) for i in range(config.num_layers))
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids) + self.embed_positions(fb.positions)
        for layer in self.layers:
            x = layer(x, fb, pool)
        return self.layer_norm(x)


class WhisperCrossKV(RequestState):
    """Each request's cross-attention K/V: one entry per encoder output row and decoder layer."""

    def extra_slots(self, config: ModelConfig, items: Sequence[MultimodalDataItem]) -> int:
        return config.cross_attention_len

    def fill(self, model: TesseraModel, encoder_outputs: list[torch.Tensor], slots: list[torch.Tensor],
             pool: TokenToKVPool) -> None:
        assert isinstance(model, WhisperForConditionalGeneration)
        model.fill_cross_kv(encoder_outputs, slots, pool)


class WhisperForConditionalGeneration(TesseraModel):
    request_state = WhisperCrossKV()
    process_logits_reads_prompt = True  # the rules read the decoder prompt (language detection, <|notimestamps|>)

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend, language_model_only: bool = False):
        super().__init__()
        if language_model_only:
            raise ValueError("language_model_only: Whisper's decoder needs its audio encoder (it cross-attends "
                             "to it)")
        self.config = config
        self.attn_backend = attn_backend
        self.decoder = WhisperDecoder(config, attn_backend)
        self.encoder = build_transformers_tower(ENCODER, config.hf_config)
        self.proj_out = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        if self.proj_out is not None:  # a Linear, not our VocabEmbedding: says so itself (layers/lora/adapter.py)
            self.proj_out.lora_refusal = "LoRA on embeddings and the LM head is not supported"
        self.num_input_frames = 2 * int(config.hf_config.max_source_positions)
        self.num_mel_bins = int(config.hf_config.num_mel_bins)
        self.tokens = WhisperTokens.from_generation_config(config.generation_config, config.hf_config)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """transformers' names: `model.encoder.*`, `model.decoder.*`, `proj_out.weight` (dropped when tied)."""
        return WeightMapping(prefix_rules=(
            ("model.encoder.", "encoder."),
            ("model.decoder.", "decoder."),
            ("proj_out.", None if config.tie_word_embeddings else "proj_out."),
        ))

    def encoders(self) -> dict[Modality, Encoder]:
        return {Modality.AUDIO: self.encode_audio}

    def lora_on_token_rows(self, module: str) -> bool:
        """The decoder's linears run on the step's tokens, except cross-attention's K/V projections: those run
        once per request on its encoder output (fill_cross_kv), under its adapter as the encoder does."""
        return module.startswith("decoder.") and not module.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj"))

    # ---- encoder ------------------------------------------------------------------------------------------

    def encode_audio(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One encoder output [cross_attention_len, d_model] per item (log-mel `feature` [mel, frames]), all
        items in one encoder call; a precomputed_embedding is taken as the encoder output itself."""
        expected = (self.num_mel_bins, self.num_input_frames)
        for i, item in enumerate(items):
            if item.precomputed_embedding is None and (item.feature is None or tuple(item.feature.shape) != expected):
                shape = None if item.feature is None else tuple(item.feature.shape)
                raise ValueError(f"item {i}: audio feature has shape {shape}, the encoder takes {expected}")

        def encode(todo: list[int]) -> list[torch.Tensor]:
            weight = self.decoder.embed_tokens.weight
            feats = torch.stack([items[i].feature for i in todo]).to(weight.device, weight.dtype)
            return list(self.encoder(feats).last_hidden_state)

        return item_embeddings(items, encode, self.decoder.embed_tokens.weight)

    def fill_cross_kv(self, encoder_outputs: list[torch.Tensor], slots: list[torch.Tensor],
                      pool: TokenToKVPool) -> None:
        """Writes every layer's cross-attention K/V of each request (its encoder output) at its slots."""
        weight = self.decoder.embed_tokens.weight
        enc = torch.stack(encoder_outputs).to(weight.device, weight.dtype)
        where = torch.stack(slots).to(weight.device)
        for layer in self.decoder.layers:
            layer.fill_cross_kv(enc, where, pool)

    # ---- decoder ------------------------------------------------------------------------------------------

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.decoder(fb, pool)
        if fb.logits_indices is not None:
            hidden = hidden[fb.logits_indices]
        weight = self.decoder.embed_tokens.weight if self.proj_out is None else self.proj_out.weight
        return linear(hidden, weight)  # linear(): the proj_out weight may be 16-bit (layers/half_linear.py)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Whisper's generate rules (suppressed tokens, timestamp pairing, language detection)."""
        return self.tokens.apply(logits, [r.prompt_ids for r in rows], [r.output_ids for r in rows])
