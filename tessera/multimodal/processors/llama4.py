"""Llama-4 processor: an image is a grid of tiles plus, when there is more than one tile, the global image.

The image processor (Llama4ImageProcessor) resizes an image onto the best-fitting canvas of at most
`max_patches` tiles of `size` pixels, cuts it into a rows x cols grid (`aspect_ratios`) and, for more than one
tile, appends the whole image resized to one tile. It returns bfloat16 pixels; items carry them as float32
(every bfloat16 value is exact in float32). The prompt's placeholder is the single `<|image|>` token the chat
template writes; it expands to the layout transformers' Llama4Processor writes (`_prompt_split_image`):

    <|image_start|> [ (<|patch|> x n  <|tile_x_separator|>)... <|patch|> x n  <|tile_y_separator|> ] per row
    <|image|> <|patch|> x n <|image_end|>

where the bracketed tile rows appear only for more than one tile and n = (tile side / patch)^2 /
downsample_ratio tokens per tile. The `<|patch|>` runs (config.image_token_index) are the item's offsets, one
run per tile, global image last, the order of the tower's features; everything else is ordinary prompt text.
Because `<|image|>` is both the prompt's placeholder and part of the expanded layout, this processor finds the
item runs by the patch token itself (`_build_items`).

The image processor is called directly (with the kwargs the HF processor would merge for it), so images can be
processed without text (preprocessing-cache misses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend, size_field
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.processors.assemble import ItemFeatures, runs
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.hf_compat import ImageProcessorCall
from tessera.multimodal.processors.split import embedding_chunks
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["Llama4Processor"]

RATIO_KEY = "aspect_ratio"


class Llama4Processor(ImageProcessorCall, BaseMultimodalProcessor):
    """Llama4ForConditionalGeneration (images)."""

    processor_kwargs_class = "transformers.models.llama4.processing_llama4:Llama4ProcessorKwargs"
    hashed_image_settings = ("size", "max_patches", "resize_to_max_canvas", "image_mean", "image_std", "resample")

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        from tessera.multimodal.geometry import tokens_per_tile

        vision = hf_config.vision_config
        self.tile_shape = (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))
        self.tokens_per_tile = tokens_per_tile(vision)
        size = hf_processor.image_processor.size
        side = int(size["height"] if isinstance(size, Mapping) else size.height)
        width = int(size["width"] if isinstance(size, Mapping) else size.width)
        hf_tokens = (side // int(hf_processor.patch_size)) * (width // int(hf_processor.patch_size)) \
            // int(hf_processor.downsample_ratio)
        if (side, width) != self.tile_shape[1:] or hf_tokens != self.tokens_per_tile:
            raise ValueError(f"image processor tiles of {side}x{width} make {hf_tokens} tokens (processor patch_size="
                             f"{hf_processor.patch_size}), but the vision config takes {self.tile_shape[1]}-pixel "
                             f"tiles of {self.tokens_per_tile} tokens")
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        tokenizer = hf_processor.tokenizer
        ids = {name: tokenizer.convert_tokens_to_ids(getattr(hf_processor, attr)) for name, attr in (
            ("start", "start_of_img_token"), ("end", "end_of_img_token"), ("patch", "img_patch_token"),
            ("tile_x", "tile_token"), ("tile_y", "tile_global_token"))}
        self.start_id, self.end_id, self.patch_id = int(ids["start"]), int(ids["end"]), int(ids["patch"])
        self.tile_x_id, self.tile_y_id = int(ids["tile_x"]), int(ids["tile_y"])
        model_patch = getattr(hf_config, "image_token_id", None)
        if model_patch is not None and int(model_patch) != self.patch_id:
            raise ValueError(f"image_token_index={model_patch} is not the tokenizer's {hf_processor.img_patch_token!r} "
                             f"({self.patch_id})")
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(image_token=self.hf_processor.fake_image_token)

    # ------------------------------------------------------------ placeholders

    def layout(self, grid: tuple[int, int]) -> list[int]:
        """The token layout of one image of a rows x cols tile grid (Llama4Processor._prompt_split_image)."""
        rows, cols = grid
        patches = [self.patch_id] * self.tokens_per_tile
        out = [self.start_id]
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    out += patches + ([self.tile_x_id] if x < cols - 1 else [])
                out.append(self.tile_y_id)
        return out + [self.special_tokens.token_id(Modality.IMAGE) or 0] + patches + [self.end_id]

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Each single <|image|> -> its image's layout; ids that already hold every item's patch tokens are
        returned unchanged."""
        image = self.special_tokens.token_id(Modality.IMAGE)
        patches = sum(1 for t in input_ids if t == self.patch_id)
        needed = sum(f.num_tokens for f in features)
        if patches == needed:
            return list(input_ids)
        found = sum(1 for t in input_ids if t == image)
        if patches or found != len(features):
            raise ValueError(f"input_ids have {found} image placeholder tokens and {patches} patch tokens; expected "
                             f"{len(features)} placeholders (one per image item) or {needed} patch tokens "
                             f"(already expanded)")
        grids = iter(self._grid(f) for f in features)
        out: list[int] = []
        for t in input_ids:
            out.extend(self.layout(next(grids)) if t == image else [t])
        return out

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        """Items own consecutive `<|patch|>` tokens in prompt order (one run per tile)."""
        positions = [i for i, t in enumerate(input_ids) if t == self.patch_id]
        if len(positions) != sum(f.num_tokens for f in features):
            raise ValueError(f"input_ids have {len(positions)} image patch tokens but the items need "
                             f"{sum(f.num_tokens for f in features)}")
        items, start = [], 0
        for f, h in zip(features, hashes, strict=True):
            mine = positions[start:start + f.num_tokens]
            start += f.num_tokens
            items.append(MultimodalDataItem(modality=f.modality, hash=h, offsets=runs(mine), feature=f.feature,
                                            precomputed_embedding=f.precomputed_embedding,
                                            model_specific_data=f.model_specific_data, deferred=f.deferred))
        return items

    def _grid(self, f: ItemFeatures) -> tuple[int, int]:
        rows, cols = (int(x) for x in f.model_specific_data[RATIO_KEY].view(2).tolist())
        return rows, cols

    def num_tiles(self, grid: tuple[int, int]) -> int:
        rows, cols = grid
        return rows * cols + (1 if rows * cols > 1 else 0)

    # ------------------------------------------------------------ deferred images

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """Llama4ImageProcessor's canvas: its own find_supported_resolutions / get_best_fit give the tile grid;
        features are float32 tiles (the processor's bfloat16, widened)."""
        from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions, get_best_fit
        from transformers.image_utils import SizeDict

        ip = self.hf_processor.image_processor
        kw = self.image_processor_kwargs()
        if is_pil_backend(ip) or set(self.hf_kwargs(Modality.IMAGE)) - SHAPE_NEUTRAL_KWARGS \
                - {"max_patches", "resize_to_max_canvas"}:
            return None
        setting = lambda name: kw[name] if kw.get(name) is not None else getattr(ip, name)  # noqa: E731
        size = setting("size")
        tile = SizeDict(height=size_field(size, "height"), width=size_field(size, "width"))
        possible = torch.tensor(find_supported_resolutions(max_num_chunks=setting("max_patches"), patch_size=tile))
        target = get_best_fit((height, width), possible, resize_to_max_canvas=setting("resize_to_max_canvas"))
        grid = (int(target[0]) // tile.height, int(target[1]) // tile.width)
        c, h, w = self.tile_shape
        n = self.num_tiles(grid)
        return ImagePlan(n * self.tokens_per_tile, {RATIO_KEY: torch.tensor(list(grid))}, n * c * h * w * 4)

    # ------------------------------------------------------------ splitting

    def _ratios(self, data: Mapping[str, Any], what: str) -> list[tuple[int, int]]:
        if data.get("aspect_ratios") is None:
            raise ValueError(f"{what} image data needs 'aspect_ratios' ([rows, cols] of tiles per image)")
        ratios = _tensor(data["aspect_ratios"], "aspect_ratios").reshape(-1, 2).to(torch.long).tolist()
        if any(r <= 0 or c <= 0 for r, c in ratios):
            raise ValueError(f"aspect_ratios {ratios} must be positive tile counts")
        return [(int(r), int(c)) for r, c in ratios]

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """{'pixel_values': tiles of all images, 'aspect_ratios': [rows, cols] per image}."""
        grids = self._ratios(data, what)
        if num_items is not None and len(grids) != num_items:
            raise ValueError(f"{what} has aspect_ratios for {len(grids)} images, expected {num_items}")
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        tiles = _tensor(data["pixel_values"], "pixel_values")
        counts = [self.num_tiles(g) for g in grids]
        if (tiles.ndim != 4 or tuple(tiles.shape[1:]) != self.tile_shape or not tiles.is_floating_point()
                or tiles.shape[0] != sum(counts)):
            raise ValueError(f"pixel_values has shape {tuple(tiles.shape)} ({tiles.dtype}); aspect_ratios {grids} "
                             f"need floating-point tiles [{sum(counts)}, {', '.join(map(str, self.tile_shape))}]")
        tiles = tiles.float()  # the image processor's bfloat16, exactly
        return [ItemFeatures(Modality.IMAGE, n * self.tokens_per_tile, feature=chunk.clone(),
                             model_specific_data={RATIO_KEY: torch.tensor(list(g))})
                for n, g, chunk in zip(counts, grids, tiles.split(counts))]

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """{'feature': [tokens, hidden] or a list, one per image, 'aspect_ratios'}."""
        grids = self._ratios(data, "precomputed_embedding")
        tokens = [self.num_tiles(g) * self.tokens_per_tile for g in grids]
        chunks = embedding_chunks(data, tokens, self.embed_dim, "aspect_ratios", "projected tile embeddings")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c,
                             model_specific_data={RATIO_KEY: torch.tensor(list(g))})
                for c, n, g in zip(chunks, tokens, grids)]
