"""Llama-3.2-Vision (`MllamaForConditionalGeneration`): our decoder over the paged KV pool, with cross-attention
layers reading each request's image K/V, + transformers' MllamaVisionModel and the projector.

The text model is Llama's self-attention layers (the shared blocks, llama3-scaled RoPE) with, at the indices
`text_config.cross_attention_layers`, cross-attention layers instead: q (q-normed) from the tokens, K/V
(k-normed) from the request's projected vision states, no RoPE, the attention and MLP outputs each scaled by
tanh of a learned gate. An image is not in the token stream: its `<|image|>` token is an ordinary embedded token
(the embedding table has vocab_size + 8 rows), and the image enters only through cross-attention.

Cross-attention K/V are the family's per-request state (models/request_state.py, MllamaCrossKV): a request with
n images holds n * max_num_tiles * num_patches pool slots (every tile, padding tiles included: transformers'
vision tower lets real tiles attend to padding ones, and rows that attend to no image read them all), filled
once from the tower's output when the request is admitted, in the pool entries of the cross-attention layers
(their self-attention entries are unused), and freed with the request. A text-only request holds none; its rows
pass the cross-attention layers unchanged (zero attention output, MLP zeroed), as transformers skips them.

Which images a token attends to is transformers' cross_attention_mask: image i from its `<|image|>` token to the
next image's (consecutive images share the later end; the last one to the end of the prompt and every generated
token), only its real tiles. A token that attends to no image (text before the first `<|image|>`) attends to
every state row unmasked and its cross layers' MLP output is zeroed (full_text_row_masked_out_mask), exactly as
transformers computes it. The processor writes each image's token span into its item (CROSS_SPAN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.cache.kv_pool import TokenToKVPool
from tessera.distributed.parallel_state import tp_group
from tessera.layers.attention import BaseAttentionBackend, get_attention_backend
from tessera.layers.decoder import DecoderLayer, DecoderOptions, GatedMLP
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import Linear, ParallelLMHead, VocabParallelEmbedding
from tessera.layers.norm import RMSNorm
from tessera.layers.rotary import RotaryEmbedding, rope_inv_freq
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder, TesseraModel
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.mm_embed import item_embeddings
from tessera.models.request_state import RequestState
from tessera.models.weights import WeightMapping
from tessera.multimodal.processors.mllama import CROSS_SPAN, RATIO_ID, RATIO_MASK, tile_rows

VISION_TOWER = "transformers.models.mllama.modeling_mllama:MllamaVisionModel"
UNBOUNDED = 1 << 62  # an image span's end for hi = -1 (the items' model_specific_data, see the processor)


@dataclass(frozen=True)
class ImageKeys:
    """One image of a request's state: its rows [start, start + valid) are its real tiles', attended by the
    tokens at positions [lo, hi)."""

    start: int
    valid: int
    lo: int
    hi: int


class MllamaCrossKV(RequestState):
    """Each request's cross-attention K/V: every tile row of every image, per cross-attention layer."""

    def extra_slots(self, config: ModelConfig, items: Sequence[MultimodalDataItem]) -> int:
        tiles, rows = tile_rows(config.hf_config)
        return sum(1 for it in items if it.modality == Modality.IMAGE) * tiles * rows

    def fill(self, model: torch.nn.Module, encoder_outputs: list[torch.Tensor], slots: list[torch.Tensor],
             pool: TokenToKVPool) -> None:
        assert isinstance(model, MllamaForConditionalGeneration)
        like = model.model.embed_tokens.like  # precomputed states arrive in the caller's dtype and device
        for states, where in zip(encoder_outputs, slots):
            states = states.to(like.device, like.dtype)
            for layer in model.model.cross_layers():
                layer.cross_attn.fill(states, where, pool)

    def layout(self, config: ModelConfig, items: Sequence[MultimodalDataItem]) -> list[ImageKeys]:
        tiles, rows = tile_rows(config.hf_config)
        keys = []
        for i, it in enumerate(items):
            lo, hi = (int(x) for x in it.model_specific_data[CROSS_SPAN].tolist())
            keys.append(ImageKeys(i * tiles * rows, int(it.model_specific_data[RATIO_MASK].sum()) * rows, lo,
                                  UNBOUNDED if hi < 0 else hi))
        return keys


class MllamaCrossAttention(nn.Module):
    """q_proj / k_proj / v_proj / o_proj, q_norm and k_norm over each head (k and v stay apart: they run on a
    request's vision states under its adapter, as an encoder's single-shard linears: `fill`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scaling = self.head_dim ** -0.5
        kv = self.num_kv_heads * self.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, kv)
        self.v_proj = Linear(cfg.hidden_size, kv)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def fill(self, states: torch.Tensor, slots: torch.Tensor, pool: TokenToKVPool) -> None:
        """One request's projected vision states [L, hidden] -> this layer's K/V at its slots [L]."""
        k = self.k_norm(self.k_proj(states).reshape(-1, self.num_kv_heads, self.head_dim))
        pool.set_kv(self.layer_id, slots, k, self.v_proj(states).reshape(-1, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, plan: CrossPlan, pool: TokenToKVPool) -> torch.Tensor:
        """Every row of the step [T, hidden] (a LoRA adapter's rows are the step's); rows of requests without
        state attend to nothing: their output is o_proj(0) = 0."""
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim))
        k, v = pool.gather(self.layer_id, plan.slots, dtype=q.dtype)  # [B', L, KVH, D]
        groups = self.num_heads // self.num_kv_heads
        k = k.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B', H, L, D]
        v = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        out = torch.zeros_like(q)
        for b, (lo, hi) in enumerate(plan.rows):
            qi = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            oi = F.scaled_dot_product_attention(qi, k[b:b + 1], v[b:b + 1], attn_mask=plan.masks[b],
                                                scale=self.scaling)
            out[lo:hi] = oi[0].transpose(0, 1)
        return self.o_proj(out.reshape(x.shape[0], -1))


@dataclass
class CrossPlan:
    """A step's cross-attention inputs, shared by every cross layer: per request with state, its flat token rows
    [lo, hi), pool slots [B', L'] and boolean masks [1, 1, n, L']; and per flat row whether it attends to some
    image (`attends` [T, 1]: the cross layers' MLP output of the others is zeroed)."""

    rows: list[tuple[int, int]]
    slots: torch.Tensor
    masks: list[torch.Tensor]
    attends: torch.Tensor

    @classmethod
    def of(cls, fb: ForwardBatch) -> CrossPlan | None:
        if fb.state_slots is None or fb.state_lens is None or fb.state_layouts is None or not any(fb.state_lens):
            return None
        ext, seq, starts, _ = fb.host_plan()
        keep = [b for b, n in enumerate(fb.state_lens) if n and ext[b]]
        if not keep:
            return None
        width = max(fb.state_lens[b] for b in keep)
        device = fb.state_slots.device
        attends = torch.zeros(int(fb.input_ids.shape[0]), 1, dtype=torch.bool, device=device)
        key = torch.arange(width, device=device)[None, :]
        rows, masks = [], []
        for b in keep:
            n, length = ext[b], fb.state_lens[b]
            pos = torch.arange(seq[b] - n, seq[b], device=device)[:, None]  # Mllama positions are token indices
            mask = torch.zeros(n, width, dtype=torch.bool, device=device)
            for im in fb.state_layouts[b]:
                mask |= (pos >= im.lo) & (pos < im.hi) & (key >= im.start) & (key < im.start + im.valid)
            some = mask.any(-1, keepdim=True)
            # transformers: a row that attends to no image attends to every row of the state unmasked.
            masks.append(torch.where(some, mask, key < length)[None, None])
            rows.append((starts[b], starts[b] + n))
            attends[starts[b]:starts[b] + n] = some
        return cls(rows, fb.state_slots[keep, :width], masks, attends)


class MllamaCrossLayer(nn.Module):
    """x + tanh(attn_gate) * cross_attn(norm(x)), then + tanh(mlp_gate) * mlp(norm(.)), the MLP zeroed on rows
    that attend to no image (text before the first image; every row of a request without images, whose attention
    output is zero too: such rows pass unchanged, as transformers skips the layer for them)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cross_attn = MllamaCrossAttention(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, plan: CrossPlan, pool: TokenToKVPool) -> torch.Tensor:
        x = x + self.cross_attn_attn_gate.tanh() * self.cross_attn(self.input_layernorm(x), plan, pool)
        mlp = self.mlp(self.post_attention_layernorm(x)) * plan.attends
        return x + self.cross_attn_mlp_gate.tanh() * mlp


class MllamaTextModel(nn.Module):
    """`model.*`: embedding table (vocab_size + 8 rows), self- and cross-attention layers, final norm."""

    def __init__(self, cfg: ModelConfig, attn_backend: BaseAttentionBackend):
        super().__init__()
        text = cfg.hf_config.get_text_config()
        self.cross_ids = frozenset(int(i) for i in text.cross_attention_layers)
        if any(not 0 <= i < cfg.num_layers for i in self.cross_ids):
            raise ValueError(f"text_config.cross_attention_layers={sorted(self.cross_ids)} must be layer indices "
                             f"below num_hidden_layers={cfg.num_layers}")
        self.attn_backend = attn_backend
        tp = tp_group()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size + 8, cfg.hidden_size, tp.rank, tp.size)
        self.layers = nn.ModuleList(MllamaCrossLayer(cfg, i) if i in self.cross_ids else
                                    DecoderLayer(cfg, DecoderOptions(), i, attn_backend)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        inv_freq, scaling = rope_inv_freq(cfg.rope_type, cfg.rope_theta, cfg.head_dim, text)
        if scaling != 1.0:
            raise NotImplementedError(f"rope_parameters.rope_type={cfg.rope_type!r} scales attention")
        self.rotary_emb.inv_freq.copy_(inv_freq)

    def cross_layers(self) -> list[MllamaCrossLayer]:
        return [layer for layer in self.layers if isinstance(layer, MllamaCrossLayer)]

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        cos, sin = self.rotary_emb.get_cos_sin(fb.positions, x.dtype)
        self.attn_backend.init_forward_metadata(fb)
        plan = CrossPlan.of(fb)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            if isinstance(layer, MllamaCrossLayer):
                if plan is not None:  # no request of the step has images: transformers skips the layer too
                    x, residual = layer(x if residual is None else x + residual, plan, pool), None
                continue
            x, residual = layer(x, residual, cos, sin, fb, pool)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class MllamaForConditionalGeneration(TesseraModel):
    """Image items carry `feature` (tiles [max_num_tiles, C, S, S], padding tiles zero) or a
    `precomputed_embedding` (projected vision states [max_num_tiles * rows_per_tile, hidden])."""

    request_state = MllamaCrossKV()

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__()
        self.config = config
        self.model = MllamaTextModel(config, attn_backend or get_attention_backend("torch_native"))
        tp = tp_group()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp.rank, tp.size)
        if config.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: Mllama's embedding table has 8 rows more than its LM head")
        vision = config.hf_config.vision_config
        self.max_tiles, self.rows_per_tile = tile_rows(config.hf_config)
        self.tile_shape = (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))
        self.vision_model: nn.Module | None = None
        self.multi_modal_projector: Linear | None = None
        if not language_model_only:
            self.vision_model = build_transformers_tower(VISION_TOWER, vision)
            self.multi_modal_projector = Linear(int(vision.vision_output_dim), config.hidden_size, bias=True)

    @property
    def lm_config(self) -> ModelConfig:
        return self.config

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """transformers 5's names (`model.language_model.*`, `model.vision_model.*`, `model.multi_modal_projector.*`,
        `lm_head.*`) and the Hub checkpoints' older ones (`language_model.model.*`, `language_model.lm_head.*`,
        `vision_model.*`, `multi_modal_projector.*`)."""
        tower = None if language_model_only else "vision_model."
        projector = None if language_model_only else "multi_modal_projector."
        stacked = tuple((f"self_attn.{p}_proj", "self_attn.qkv_proj", p) for p in "qkv") + \
            tuple((f"mlp.{p}_proj", "mlp.gate_up_proj", p) for p in ("gate", "up"))
        return WeightMapping(
            prefix_rules=(("model.language_model.", "model."), ("model.vision_model.", tower),
                          ("model.multi_modal_projector.", projector), ("lm_head.", "lm_head."),
                          ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                          ("vision_model.", tower), ("multi_modal_projector.", projector)),
            stacked=stacked, stacked_prefix="model.")

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_model is None else {Modality.IMAGE: self.get_image_feature}

    def lora_on_token_rows(self, module: str) -> bool:
        """Cross-attention's K/V projections run once per request on its vision states (the fill, under its
        adapter), not on the step's tokens."""
        return module.startswith("model.") and not module.endswith(("cross_attn.k_proj", "cross_attn.v_proj"))

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Projected vision states [max_num_tiles * rows_per_tile, hidden] per image item, every pixel item in one
        tower call (transformers' MllamaVisionModel with its aspect-ratio ids and tile masks)."""
        if self.vision_model is None or self.multi_modal_projector is None:
            raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
        shape = (self.max_tiles, *self.tile_shape)
        for i, it in enumerate(items):
            if it.precomputed_embedding is None and (it.feature is None or tuple(it.feature.shape) != shape):
                got = None if it.feature is None else tuple(it.feature.shape)
                raise ValueError(f"image item {i}: pixel feature has shape {got}, the vision tower takes {shape}")
        weight = self.model.embed_tokens.like

        def encode(todo: list[int]) -> list[torch.Tensor]:
            pixels = torch.stack([items[i].feature for i in todo])[None].to(weight.device, weight.dtype)
            ids = torch.stack([items[i].model_specific_data[RATIO_ID].reshape(()) for i in todo])[None]
            mask = torch.stack([items[i].model_specific_data[RATIO_MASK].reshape(-1) for i in todo])[None]
            states = self.vision_model(pixel_values=pixels, aspect_ratio_ids=ids.to(weight.device),
                                       aspect_ratio_mask=mask.to(weight.device)).last_hidden_state
            return list(self.multi_modal_projector(states[0]).flatten(1, 2))

        return item_embeddings(items, encode, weight)

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool) -> torch.Tensor:
        hidden = self.model(self.model.embed_tokens(fb.input_ids), fb, pool)
        if fb.hidden_indices is not None:
            fb.hidden_states = hidden[fb.hidden_indices]
        rows = fb.logits_indices if fb.logits_indices is not None else fb.extend_start_loc + fb.extend_lens - 1
        return self.lm_head(hidden[rows])
