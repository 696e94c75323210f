"""InternVL processor: dynamically tiled images, each wrapped as <img> <IMG_CONTEXT> x N </img>.

The image processor (GotOcr2) cuts an image into a grid of image_size x image_size tiles whose aspect
ratio best fits the image (between min_patches and max_patches tiles) and, when there is more than one tile,
appends a thumbnail of the whole image. An item owns its tiles (`feature` [num_tiles, C, H, W], thumbnail
last) and num_tiles * image_seq_length placeholder tokens. The prompt's placeholder is the single
<IMG_CONTEXT> token the chat template writes; it expands to <img>, the item's context tokens and </img>, as
transformers' InternVLProcessor does (the wrappers are ordinary tokens of the prompt, not of the item).

The HF processor is called for its image processor only (with the kwargs it would merge for it): the
InternVL processor refuses calls without text and drops `num_patches`, which splitting needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend, size_field
from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.hf_compat import ImageProcessorCall
from tessera.multimodal.processors.split import as_tensors

__all__ = ["InternVLProcessor"]


class InternVLProcessor(ImageProcessorCall, BaseMultimodalProcessor):
    """InternVLForConditionalGeneration (images)."""

    processor_kwargs_class = "transformers.models.internvl.processing_internvl:InternVLProcessorKwargs"
    hashed_image_settings = ("size", "crop_to_patches", "min_patches", "max_patches", "image_mean", "image_std")

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        vision = hf_config.vision_config
        size = vision.image_size if isinstance(vision.image_size, (list, tuple)) else (vision.image_size,) * 2
        patch = vision.patch_size if isinstance(vision.patch_size, (list, tuple)) else (vision.patch_size,) * 2
        ratio = float(hf_config.downsample_ratio)
        # What the model makes of one tile; the HF processor expands by its own image_seq_length, so they must agree.
        tokens_per_tile = int(size[0] // patch[0] * ratio) * int(size[1] // patch[1] * ratio)
        self.image_seq_length = int(hf_processor.image_seq_length)
        if self.image_seq_length != tokens_per_tile:
            raise ValueError(f"processor image_seq_length={self.image_seq_length}, but the vision config makes "
                             f"{tokens_per_tile} tokens per {size[0]}x{size[1]} tile")
        self.tile_shape = (int(getattr(vision, "num_channels", 3)), int(size[0]), int(size[1]))
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        tokenizer = hf_processor.tokenizer
        self.start_image_id = int(tokenizer.convert_tokens_to_ids(hf_processor.start_image_token))
        self.end_image_id = int(tokenizer.convert_tokens_to_ids(hf_processor.end_image_token))
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    # ------------------------------------------------------------ placeholders

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Each single <IMG_CONTEXT> -> <img>, num_tokens context tokens, </img>; ids that already hold every
        item's context tokens are returned unchanged."""
        context = self.special_tokens.token_id(Modality.IMAGE)
        found = sum(1 for t in input_ids if t == context)
        needed = sum(f.num_tokens for f in features)
        # With one token per image both forms hold one <IMG_CONTEXT> per image: expanded ids wrap it in <img>.
        opened = sum(1 for t, nxt in zip(input_ids, input_ids[1:]) if t == self.start_image_id and nxt == context)
        if found == needed and (found != len(features) or opened == len(features)):
            return list(input_ids)
        if found != len(features):
            raise ValueError(f"input_ids have {found} image placeholder tokens; expected {len(features)} (one per "
                             f"image item) or {needed} (already expanded)")
        counts = iter(f.num_tokens for f in features)
        out: list[int] = []
        for t in input_ids:
            out.extend([self.start_image_id, *[t] * next(counts), self.end_image_id] if t == context else [t])
        return out

    # ------------------------------------------------------------ deferred images

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """GotOcr2's tiling: the grid of `size` tiles whose aspect ratio best fits the image (its own
        get_optimal_tiled_canvas, between min_patches and max_patches), plus a thumbnail when it has more
        than one tile; one tile without crop_to_patches."""
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

        ip = self.hf_processor.image_processor
        kw = self.image_processor_kwargs()
        if is_pil_backend(ip) or set(self.hf_kwargs(Modality.IMAGE)) - SHAPE_NEUTRAL_KWARGS \
                - {"crop_to_patches", "min_patches", "max_patches"}:
            return None
        setting = lambda name: kw[name] if kw.get(name) is not None else getattr(ip, name)  # noqa: E731
        tiles = 1
        if setting("crop_to_patches"):
            size = setting("size")
            cols, rows = get_optimal_tiled_canvas((height, width), (size_field(size, "height"),
                                                  size_field(size, "width")),
                                                  setting("min_patches"), setting("max_patches"))
            tiles += cols * rows if cols * rows > 1 else 0
        c, h, w = self.tile_shape
        return ImagePlan(tiles * self.image_seq_length, {}, tiles * c * h * w * 4)

    # ------------------------------------------------------------ splitting

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """{'pixel_values': tiles, 'num_patches': tiles per image}."""
        if data.get("pixel_values") is None or data.get("num_patches") is None:
            raise ValueError(f"{what} image data needs 'pixel_values' and 'num_patches'")
        tiles = _tensor(data["pixel_values"], "pixel_values")
        counts = [int(n) for n in _tensor(data["num_patches"], "num_patches").reshape(-1).tolist()]
        if num_items is not None and len(counts) != num_items:
            raise ValueError(f"{what} has num_patches for {len(counts)} images, expected {num_items}")
        if (tiles.ndim != 4 or tuple(tiles.shape[1:]) != self.tile_shape or not tiles.is_floating_point()
                or any(n <= 0 for n in counts) or tiles.shape[0] != sum(counts)):
            raise ValueError(f"pixel_values has shape {tuple(tiles.shape)} ({tiles.dtype}); num_patches {counts} "
                             f"needs floating-point tiles [{sum(counts)}, {', '.join(map(str, self.tile_shape))}]")
        # clone(): a slice view would drag the whole batch's storage along when the item is sent on.
        return [ItemFeatures(Modality.IMAGE, n * self.image_seq_length, feature=chunk.clone())
                for n, chunk in zip(counts, tiles.split(counts))]

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """{'feature': [num_tokens, hidden] or a list of them, one per image}."""
        if data.get("feature") is None:
            raise ValueError("precomputed_embedding image data needs 'feature' (projected tile tokens)")
        out = []
        for chunk in as_tensors(data["feature"], "feature"):
            if (chunk.ndim != 2 or chunk.shape[1] != self.embed_dim or chunk.shape[0] % self.image_seq_length
                    or chunk.shape[0] == 0 or not chunk.is_floating_point()):
                raise ValueError(f"precomputed image feature has shape {tuple(chunk.shape)}; the language model "
                                 f"takes [num_tiles * {self.image_seq_length}, {self.embed_dim}] floating-point rows")
            out.append(ItemFeatures(Modality.IMAGE, int(chunk.shape[0]), precomputed_embedding=chunk))
        return out
