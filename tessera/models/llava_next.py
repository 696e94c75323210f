"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA with "anyres" images.

An image of (height, width) is resized into the best of `image_grid_pinpoints` (tessera.multimodal.anyres),
cut into tiles of the tower's `image_size`, and preceded by a base tile (the whole image resized); the processor
sends all of them as one item ([num_tiles, C, S, S], padding tiles removed) with its `image_sizes`. Every tile
goes through the tower and the projector (all tiles of a step in one call); then, as transformers'
`pack_image_features`: the grid tiles' features are laid out as one (rows x side, cols x side) feature map, the
padding the resize left is cut off (`unpad_image`), `image_newline` is appended at the end of every row, and the
base tile's features come first. Token count: tessera.models.llava.LlavaImageGeometry.num_image_tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.models.config import ModelConfig
from tessera.models.llava import LlavaForConditionalGeneration
from tessera.multimodal import anyres
from tessera.messages.items import MultimodalDataItem
from tessera.multimodal.geometry import IMAGE_SIZES_KEY




class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """Items carry `feature` (tiles [num_tiles, C, S, S], base tile first) and model_specific_data
    ["image_sizes"], or a `precomputed_embedding`."""

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        g = self.geometry
        if g.grid_pinpoints is None:
            raise ValueError("LLaVA-NeXT needs config.image_grid_pinpoints")
        if g.tokens_per_tile != g.patches_per_side**2:
            # transformers views each tile's features as a side x side map, which a kept CLS token breaks.
            raise ValueError(f"vision_feature_select_strategy={g.select_strategy!r} with a tower that "
                             f"{'has' if g.has_cls else 'lacks'} a CLS token gives {g.tokens_per_tile} features per "
                             f"tile, not {g.patches_per_side}x{g.patches_per_side}: LLaVA-NeXT cannot lay them out")
        self.image_newline: nn.Parameter | None = (
            None if language_model_only else nn.Parameter(torch.empty(config.hidden_size)))

    @classmethod
    def extra_prefix_rules(cls, language_model_only: bool) -> tuple[tuple[str, str | None], ...]:
        newline = None if language_model_only else "image_newline"
        return (("model.image_newline", newline), ("image_newline", newline))

    def item_tiles(self, i: int, item: MultimodalDataItem) -> torch.Tensor:
        g = self.geometry
        size = self.image_size_of(i, item)
        expected = (g.num_tiles(size), g.num_channels, g.image_size, g.image_size)
        if item.feature is None or tuple(item.feature.shape) != expected:
            shape = None if item.feature is None else tuple(item.feature.shape)
            raise ValueError(f"image item {i} of size {size}: tiles have shape {shape}, expected {expected}")
        return item.feature

    @staticmethod
    def image_size_of(i: int, item: MultimodalDataItem) -> tuple[int, int]:
        sizes = item.model_specific_data.get(IMAGE_SIZES_KEY)
        if sizes is None:
            raise ValueError(f"image item {i}: model_specific_data lacks {IMAGE_SIZES_KEY!r}")
        h, w = (int(v) for v in sizes.reshape(-1).tolist())
        return h, w

    def pack_item(self, item: MultimodalDataItem, features: torch.Tensor) -> torch.Tensor:
        """Tile features [n, side*side, hidden] -> [num_image_tokens, hidden] (transformers' layout)."""
        assert self.image_newline is not None
        newline = self.image_newline.to(features.dtype)
        base, grid = features[0], features[1:]
        if grid.shape[0] == 0:
            return torch.cat([base, newline[None]])
        g = self.geometry
        size = self.image_size_of(0, item)
        rows, cols = anyres.get_anyres_image_grid_shape(size, g.grid_pinpoints or (), g.image_size)
        side = g.patches_per_side
        # [rows*cols, side*side, D] -> [D, rows*side, cols*side]: tile (r, c) patch (y, x) at (r*side+y, c*side+x)
        fmap = grid.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        fmap = anyres.unpad_image(fmap, size)
        fmap = torch.cat([fmap, newline[:, None, None].expand(-1, fmap.shape[1], 1)], dim=-1)
        return torch.cat([base, fmap.flatten(1, 2).transpose(0, 1)])
