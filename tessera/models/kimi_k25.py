"""Kimi-K2.5 (`Kimi_K25ForConditionalGeneration`): our DeepSeek-V3 text decoder over the paged KV cache
(layers/deepseek_decoder.py: multi-head latent attention, DeepSeek-V3 routed + shared experts) + transformers'
`Kimi_K25VisionModel` (MoonViT) + the projector.

An image is a grid of 14 x 14 patches (pixel_values [h * w, 3, 14, 14] and its image_grid_thw [1, h, w] from the
image processor); the tower runs all of a call's images as one packed sequence (block-diagonal attention) and
pools each merge_kernel_size block (2 x 2) of patches into one [4, vision_hidden] row; the projector
(LayerNorm per patch, the 4 patches concatenated, in_proj, GELU, out_proj) maps it to the text width. Image i
fills (h / 2) * (w / 2) `<|media_pad|>` tokens (config.image_token_id), row by row.

Checkpoint names: Moonshot's own (`language_model.model.layers.*` with one tensor per expert,
`vision_tower.encoder.blocks.*` with a fused `wqkv` in the interleaved rotary layout, `mm_projector.proj.{0,2}`),
which transformers 5.24's `save_pretrained` also writes, with three quirks read here too: the text model's
`layers` renamed `blocks`, `vision_tower.encoder.patch_embed` and `model.mm_projector.pre_norm`. The fused qkv is
split and its q/k rows permuted as transformers' loader does (Chunk + PermuteForRope). transformers' in-memory
module names (`model.language_model.*`, `model.vision_tower.*`, `model.mm_projector.*`: what PEFT adapters name)
map too, for the linear layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.layers.deepseek_decoder import DeepseekDecoderModel
from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import Linear
from tessera.layers.mla import MLA_STACKED_PARAMS
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.mm_embed import merge_mm_embeddings
from tessera.models.weights import WeightMapping

VISION_TOWER = "transformers.models.kimi_k25.modeling_kimi_k25:Kimi_K25VisionModel"
GRID_KEY = "image_grid_thw"

# Checkpoint name -> ours, first match wins; applied before the prefix rules (which then only drop or keep).
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^language_model\.model\.(?:blocks|layers)\.", "model.layers."),
    (r"^(?:language_model\.model|model\.language_model)\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0\.", r"vision_tower.layers.\1.norm1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1\.", r"vision_tower.layers.\1.norm2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.", r"vision_tower.layers.\1.mlp.fc1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.", r"vision_tower.layers.\1.mlp.fc2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\.", r"vision_tower.layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.attn\.", r"vision_tower.layers.\1.attn."),
    (r"^vision_tower\.patch_embed\.pos_emb\.weight$", "vision_tower.patch_embed.pos_emb.position_embeddings"),
    (r"^vision_tower\.encoder\.", "vision_tower."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^mm_projector\.proj\.0\.", "mm_projector.in_proj."),
    (r"^mm_projector\.proj\.2\.", "mm_projector.out_proj."),
    (r"^model\.mm_projector\.", "mm_projector."),
)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_WQKV = re.compile(r"^(vision_tower\.encoder\.blocks\.\d+)\.wqkv\.(weight|bias)$")


@dataclass(frozen=True)
class KimiWeightMapping(WeightMapping):
    """Moonshot's and transformers' checkpoint names (module docstring) onto ours."""

    vision_heads: int = 1  # the fused qkv's rotary permutation is per head
    # Layers from here on are DeepSeek's multi-token prediction modules (`num_nextn_predict_layers`), which
    # transformers does not load either: dropped.
    num_layers: int = 1 << 30

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The vision blocks' fused wqkv -> q, k, v, q and k permuted from interleaved rotary pairs to halves
        (transformers' Chunk + PermuteForRope)."""
        m = _WQKV.match(name)
        if m is None:
            return [(name, tensor)]
        out = []
        for part, t in zip(("q", "k", "v"), tensor.chunk(3, dim=0)):
            if part != "v":
                rows = t.shape[0]
                t = t.reshape(self.vision_heads, rows // self.vision_heads // 2, 2, *t.shape[1:])
                t = t.transpose(1, 2).reshape(rows, *t.shape[3:])
            out.append((f"{m.group(1)}.attn.{part}_proj.{m.group(2)}", t.contiguous()))
        return out

    def map_name(self, name: str) -> tuple[str, str | None] | None:
        for pattern, repl in _RENAMES:
            renamed, n = re.subn(pattern, repl, name, count=1)
            if n:
                name = renamed
                break
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.num_layers:
            return None
        expert = _EXPERT.match(name)
        if expert is not None:
            stack, e, proj = expert.groups()
            return (f"{stack}.down.weight", e) if proj == "down" else (f"{stack}.gate_up.weight", f"{e}.{proj}")
        return super().map_name(name)


class KimiK25Projector(nn.Module):
    """Pooled patches [n, k, vision_hidden] -> [n, hidden]: LayerNorm per patch, the k patches concatenated,
    in_proj, GELU (erf), out_proj (transformers' Kimi_K25MultimodalProjection)."""

    def __init__(self, vision_hidden: int, kernel: int, hidden: int, eps: float):
        super().__init__()
        width = vision_hidden * kernel
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=eps)
        self.in_proj = Linear(width, width, bias=True)
        self.out_proj = Linear(width, hidden, bias=True)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(pooled).reshape(pooled.shape[0], -1)
        return self.out_proj(nn.functional.gelu(self.in_proj(x)))


def check_config(hf_config) -> None:
    """One clear error naming the field, before any weight is read."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        raise ValueError("vision_config: a Kimi_K25ForConditionalGeneration config needs one")
    text = hf_config.get_text_config()
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(text, name, None):
            raise ValueError(f"text_config.{name}: the text model is DeepSeek-V3's multi-head latent attention, "
                             f"which needs it (got {getattr(text, name, None)!r})")
    merge = list(vision.merge_kernel_size)
    if len(merge) != 2 or min(merge) < 1:
        raise ValueError(f"vision_config.merge_kernel_size={merge}: two positive sizes expected")
    if int(hf_config.projection_hidden_size) != int(vision.hidden_size):
        raise ValueError(f"projection_hidden_size={hf_config.projection_hidden_size} differs from "
                         f"vision_config.hidden_size={vision.hidden_size} (the projector normalises each patch)")


class Kimi_K25ForConditionalGeneration(CausalLM):  # noqa: N801 (transformers' architecture name)
    """Image items carry `feature` (pixel_values [h * w, 3, p, p]) and model_specific_data["image_grid_thw"]
    ([1, 1, h, w]), or a `precomputed_embedding` [(h / 2) * (w / 2), hidden]."""

    decoder_model_class = DeepseekDecoderModel
    cuda_graph_decode = True  # MLA, the router and the grouped experts' Triton kernel read nothing back

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        check_config(config.hf_config)
        super().__init__(config, attn_backend, language_model_only)
        hf = config.hf_config
        vision = hf.vision_config
        self.merge = tuple(int(m) for m in vision.merge_kernel_size)
        self.vision_tower: nn.Module | None = None
        self.mm_projector: KimiK25Projector | None = None
        if not language_model_only:
            self.vision_tower = build_transformers_tower(VISION_TOWER, vision)
            self.mm_projector = KimiK25Projector(int(vision.hidden_size), self.merge[0] * self.merge[1],
                                                 config.hidden_size, float(hf.projection_layer_norm_eps))

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        check_config(config.hf_config)
        keep_tower = None if language_model_only else "vision_tower."
        return KimiWeightMapping(
            prefix_rules=(("model.", "model."), ("lm_head.", None if config.tie_word_embeddings else "lm_head."),
                          ("vision_tower.", keep_tower),
                          ("mm_projector.", None if language_model_only else "mm_projector.")),
            stacked=MLA_STACKED_PARAMS + STACKED_PARAMS[3:],  # gate/up of the dense MLPs and shared experts
            stacked_prefix="model.",
            vision_heads=int(config.hf_config.vision_config.num_attention_heads), num_layers=config.num_layers,
        )

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """transformers embeds media placeholder ids as token 0 (their rows are then replaced by the media's), so a
        GENERATED <|media_pad|> is token 0's embedding in the next step: the same here."""
        ids = fb.input_ids
        for media in (self.config.image_token_id, self.config.video_token_id):
            if media is not None:  # compared with a Python int: no host tensor in a captured decode step
                ids = ids.masked_fill(ids == media, 0)
        return merge_mm_embeddings(self.model.embed_tokens(ids), fb.mm_embed_rows, fb.mm_embeds)

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.vision_tower is None else {Modality.IMAGE: self.get_image_feature}

    def _grid(self, i: int, item: MultimodalDataItem) -> torch.Tensor:
        grid = item.model_specific_data.get(GRID_KEY)
        feature = item.feature
        if grid is None or feature is None:
            raise ValueError(f"image item {i}: needs pixel_values and {GRID_KEY}")
        grid = torch.as_tensor(grid).reshape(-1, 3).to(torch.long)
        t, h, w = (int(x) for x in grid[0])
        p = int(self.config.hf_config.vision_config.patch_size)
        if grid.shape[0] != 1 or t != 1 or h % self.merge[0] or w % self.merge[1] \
                or tuple(feature.shape) != (h * w, 3, p, p):
            raise ValueError(f"image item {i}: {GRID_KEY} {grid.tolist()} and pixel_values {tuple(feature.shape)} do "
                             f"not describe one image of [h * w, 3, {p}, {p}] patches, h and w multiples of "
                             f"{self.merge}")
        return grid

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [(h / 2) * (w / 2), hidden] per image item, in order; all pixel items in one tower call;
        precomputed embeddings pass through (cast to the model's dtype/device)."""
        weight = self.model.embed_tokens.like
        grids = {i: self._grid(i, it) for i, it in enumerate(items) if it.precomputed_embedding is None}

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.vision_tower is None or self.mm_projector is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
            pixels = torch.cat([items[i].feature for i in todo]).to(device=weight.device, dtype=weight.dtype)
            grid = torch.cat([grids[i] for i in todo]).to(weight.device)
            pooled = self.vision_tower(pixels, grid_thw=grid).pooler_output
            sizes = (grid[:, 1] * grid[:, 2] // (self.merge[0] * self.merge[1])).tolist()
            return list(self.mm_projector(pooled).split(sizes))

        return self.encode_items(items, encode)
