"""InternVL (`InternVLForConditionalGeneration`): our language model (Qwen2, Qwen3 or Llama, as text_config
says) over the paged KV cache + transformers' InternVL vision tower.

An image arrives as tiles of image_size x image_size pixels (the processor's dynamic tiling: a grid of tiles
chosen by aspect ratio, plus a thumbnail of the whole image when there is more than one tile). Each tile goes
through the tower (`InternVLVisionModel`, a ViT with a CLS token); we keep the hidden states of
`vision_feature_layer` without the CLS token, fold them back into the patch grid, pixel-shuffle it by
`downsample_ratio` (each 2x2 block of patches becomes one token 4x as wide, for ratio 0.5) and project it to
the language model's width (`multi_modal_projector`: LayerNorm, linear, activation, linear). A tile gives
image_seq_length = (image_size / patch_size * downsample_ratio)**2 tokens; an image's embedding is its tiles'
tokens in order. All tiles have one size, so every image of a step goes through the tower in ONE batched call.

Checkpoint names: as saved (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`) or transformers 5.x's in-memory names (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.linear import Linear
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.text_backbones import WrappedTextModel
from tessera.messages.items import MultimodalDataItem

VISION_TOWER = "transformers.models.internvl.modeling_internvl:InternVLVisionModel"


def pixel_shuffle(features: torch.Tensor, ratio: float) -> torch.Tensor:
    """[N, S, S, C] -> [N, S*ratio, S*ratio, C/ratio**2], the order InternVL's checkpoints were trained with:
    the second axis is folded first, then (after a transpose) the first, and the transpose is undone."""
    n, s1, s2, c = features.shape
    if (s1 * ratio) % 1 or (s2 * ratio) % 1:
        raise ValueError(f"a {s1}x{s2} patch grid does not pixel-shuffle by downsample_ratio={ratio}")
    x = features.reshape(n, s1, int(s2 * ratio), int(c / ratio))
    x = x.permute(0, 2, 1, 3).reshape(n, int(s2 * ratio), int(s1 * ratio), int(c / ratio**2))
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLMultiModalProjector(nn.Module):
    """Pixel-shuffled vision width -> language-model width; names as transformers' projector."""

    def __init__(self, in_dim: int, text_dim: int, act: str, eps: float = 1e-5):
        super().__init__()
        from transformers.activations import ACT2FN

        self.layer_norm = nn.LayerNorm(in_dim, eps=eps)
        self.linear_1 = Linear(in_dim, text_dim, bias=True)
        self.act = ACT2FN[act]
        self.linear_2 = Linear(text_dim, text_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLForConditionalGeneration(WrappedTextModel, CausalLM):
    """The worker encodes images with encoders() (or takes them from its encoder cache) and puts the rows of
    this step's <IMG_CONTEXT> tokens into fb.mm_embed_rows / fb.mm_embeds."""

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        hf = config.hf_config
        vision = hf.vision_config
        self.downsample_ratio = float(hf.downsample_ratio)
        self.feature_layer = hf.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise NotImplementedError(f"vision_feature_layer={self.feature_layer!r}: only one layer is supported")
        if hf.vision_feature_select_strategy != "default":
            # transformers folds the features into a square grid, which only works without the CLS token.
            raise NotImplementedError(
                f"vision_feature_select_strategy={hf.vision_feature_select_strategy!r}: only 'default' is supported")
        self.vision_tower: nn.Module | None = None
        self.multi_modal_projector: InternVLMultiModalProjector | None = None
        if not language_model_only:
            self.vision_tower = build_transformers_tower(VISION_TOWER, vision)
            width = int(vision.hidden_size) * int(1 / self.downsample_ratio) ** 2
            self.multi_modal_projector = InternVLMultiModalProjector(width, config.hidden_size,
                                                                     str(hf.projector_hidden_act))

    # ---- image encoding ---------------------------------------------------------------------------------

    def tile_features(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, image_size, image_size] -> projected tokens [N, image_seq_length, hidden]."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("the model was loaded with language_model_only=True: it has no vision tower")
        if self.feature_layer == -1:
            hidden = self.vision_tower(pixel_values=tiles).last_hidden_state
        else:
            hidden = self.vision_tower(pixel_values=tiles, output_hidden_states=True).hidden_states[
                self.feature_layer]
        hidden = hidden[:, 1:]  # drop the CLS token
        n, num_patches, width = hidden.shape
        side = int(num_patches**0.5)
        if side * side != num_patches:
            raise ValueError(f"the vision tower gave {num_patches} patches per tile, not a square grid")
        grid = pixel_shuffle(hidden.reshape(n, side, side, width), self.downsample_ratio)
        return self.multi_modal_projector(grid.reshape(n, -1, grid.shape[-1]))

    def get_image_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tiles * image_seq_length, hidden] per image item, in order; the tiles of all
        pixel items go through the tower in one call. Each item carries `feature` (its tiles [num_tiles, C, H,
        W], thumbnail last) or a `precomputed_embedding` (returned as is, cast to the model's dtype/device)."""
        weight = self.model.embed_tokens.like
        for i, item in enumerate(items):
            if item.precomputed_embedding is None and (item.feature is None or item.feature.ndim != 4):
                raise ValueError(f"image item {i}: feature must be the image's tiles [num_tiles, C, H, W]")

        def encode(todo: list[int]) -> list[torch.Tensor]:
            tiles = [items[i].feature for i in todo]
            batch = torch.cat(tiles).to(device=weight.device, dtype=weight.dtype)  # type: ignore[arg-type]
            tokens = self.tile_features(batch)
            per_item = tokens.split([t.shape[0] for t in tiles])  # type: ignore[union-attr]
            return [t.reshape(-1, t.shape[-1]) for t in per_item]

        return self.encode_items(items, encode)
