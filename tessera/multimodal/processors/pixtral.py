"""Pixtral processor (LLaVA with a Pixtral tower): images at native resolution, one [IMG] per patch, rows
closed by [IMG_BREAK], the last row by [IMG_END].

The image processor caps the longest edge (size["longest_edge"]) and rounds each side up to a multiple of the
patch size; an image of h x w pixels then owns (h / patch) * (w / patch) [IMG] tokens, laid out row by row:
    [IMG] x w/patch [IMG_BREAK]  ...  [IMG] x w/patch [IMG_END]
as transformers' PixtralProcessor writes it. The [IMG] runs are the item's offsets (one run per row); the
break and end tokens are ordinary prompt tokens. An item's `feature` is its own pixels [C, h, w] (the HF
batch's padding cropped off); model_specific_data["image_sizes"] holds [[h, w]].

The image processor is called directly, with the kwargs the HF processor would merge for it (and its patch
size, patch_size * spatial_merge_size), so that images can be processed without text (preprocessing-cache
misses); the prompt's single [IMG] placeholders are expanded here, token for token as HF expands its text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend, size_field
from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.hf_compat import ImageProcessorCall
from tessera.multimodal.processors.split import embedding_chunks

__all__ = ["PixtralProcessor"]

SIZES_KEY = "image_sizes"


class PixtralProcessor(ImageProcessorCall, BaseMultimodalProcessor):
    """LlavaForConditionalGeneration with a Pixtral vision config (images)."""

    processor_kwargs_class = "transformers.models.pixtral.processing_pixtral:PixtralProcessorKwargs"
    hashed_image_settings = ("size", "image_mean", "image_std", "resample")

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        vision = hf_config.vision_config
        self.patch_size = int(vision.patch_size)
        merge = int(getattr(hf_processor, "spatial_merge_size", 1))
        if merge != 1 or int(hf_processor.patch_size) != self.patch_size:
            raise ValueError(f"processor patch_size={hf_processor.patch_size}, spatial_merge_size={merge}: a LLaVA "
                             f"Pixtral tower takes unmerged patches of vision_config.patch_size={self.patch_size}")
        self.num_channels = int(getattr(vision, "num_channels", 3))
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        tokenizer = hf_processor.tokenizer
        self.break_id = int(tokenizer.convert_tokens_to_ids(hf_processor.image_break_token))
        self.end_id = int(tokenizer.convert_tokens_to_ids(hf_processor.image_end_token))
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    # ------------------------------------------------------------ HF calls

    def extra_image_kwargs(self) -> dict[str, Any]:
        return {"patch_size": self.patch_size}

    # ------------------------------------------------------------ placeholders

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Each single [IMG] -> its rows of [IMG] tokens, [IMG_BREAK] after each row but the last, [IMG_END]
        after the last; ids that already hold every item's [IMG] tokens are returned unchanged."""
        image = self.special_tokens.token_id(Modality.IMAGE)
        found = sum(1 for t in input_ids if t == image)
        needed = sum(f.num_tokens for f in features)
        # An image of one patch is a single [IMG] either way: expanded ids close every image with [IMG_END].
        closed = sum(1 for t, nxt in zip(input_ids, input_ids[1:]) if t == image and nxt == self.end_id)
        if found == needed and (found != len(features) or closed == len(features)):
            return list(input_ids)
        if found != len(features):
            raise ValueError(f"input_ids have {found} image placeholder tokens; expected {len(features)} (one per "
                             f"image item) or {needed} (already expanded)")
        grids = iter(self._grid(f) for f in features)
        out: list[int] = []
        for t in input_ids:
            if t != image:
                out.append(t)
                continue
            rows, cols = next(grids)
            for r in range(rows):
                out.extend([image] * cols + [self.end_id if r == rows - 1 else self.break_id])
        return out

    def _grid(self, f: ItemFeatures) -> tuple[int, int]:
        h, w = (int(x) for x in f.model_specific_data[SIZES_KEY].view(2).tolist())
        return h // self.patch_size, w // self.patch_size

    # ------------------------------------------------------------ splitting

    def _sizes(self, data: Mapping[str, Any], what: str) -> list[tuple[int, int]]:
        if data.get(SIZES_KEY) is None:
            raise ValueError(f"{what} image data needs {SIZES_KEY!r} ([height, width] per image)")
        sizes = _tensor(data[SIZES_KEY], SIZES_KEY).reshape(-1, 2).to(torch.long).tolist()
        p = self.patch_size
        for h, w in sizes:
            if h <= 0 or w <= 0 or h % p or w % p:
                raise ValueError(f"{SIZES_KEY} {sizes}: heights and widths must be positive multiples of the "
                                 f"patch size {p}")
        return [(int(h), int(w)) for h, w in sizes]

    def _num_tokens(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size)

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """{'pixel_values': [N, C, H, W] (padded) or a list of [C, h, w], 'image_sizes'}."""
        sizes = self._sizes(data, what)
        if num_items is not None and len(sizes) != num_items:
            raise ValueError(f"{what} has {SIZES_KEY} for {len(sizes)} images, expected {num_items}")
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        value = data["pixel_values"]
        images = ([_tensor(v, "pixel_values") for v in value] if isinstance(value, (list, tuple))
                  else list(_tensor(value, "pixel_values")))
        if len(images) != len(sizes):
            raise ValueError(f"pixel_values holds {len(images)} images, {SIZES_KEY} {len(sizes)}")
        out = []
        for im, (h, w) in zip(images, sizes):
            if im.ndim != 3 or im.shape[0] != self.num_channels or im.shape[1] < h or im.shape[2] < w \
                    or not im.is_floating_point():
                raise ValueError(f"pixel_values image of shape {tuple(im.shape)} ({im.dtype}) does not hold a "
                                 f"{h}x{w} image of {self.num_channels} floating-point channels")
            # clone(): the crop would otherwise drag the whole padded batch along when the item is sent on.
            out.append(ItemFeatures(Modality.IMAGE, self._num_tokens(h, w),
                                    feature=im[:, :h, :w].clone(),
                                    model_specific_data={SIZES_KEY: torch.tensor([[h, w]])}))
        return out

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """The image processor's own resize rule (longest edge capped, sides rounded up to whole patches),
        evaluated on a zero-stride stand-in of the image's shape."""
        from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

        ip = self.hf_processor.image_processor
        kw = self.image_processor_kwargs()
        size, patch = kw.get("size") or ip.size, kw.get("patch_size") or ip.patch_size
        longest = size_field(size, "longest_edge")
        ph, pw = (patch, patch) if isinstance(patch, int) else (size_field(patch, "height"), size_field(patch, "width"))
        if is_pil_backend(ip) or not longest or not ph or not pw or not kw.get("do_resize", True) \
                or kw.get("do_center_crop") or set(self.hf_kwargs(Modality.IMAGE)) - SHAPE_NEUTRAL_KWARGS - {"size"}:
            return None
        stand_in = np.broadcast_to(np.uint8(0), (self.num_channels, height, width))
        h, w = get_resize_output_image_size(stand_in, size=(longest, longest), patch_size=(ph, pw),
                                            input_data_format="channels_first")
        return ImagePlan(self._num_tokens(h, w), {SIZES_KEY: torch.tensor([[h, w]])},
                         self.num_channels * h * w * 4)

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """{'feature': [sum of tokens, hidden] or a list, one per image, 'image_sizes'}."""
        sizes = self._sizes(data, "precomputed_embedding")
        tokens = [self._num_tokens(h, w) for h, w in sizes]
        chunks = embedding_chunks(data, tokens, self.embed_dim, SIZES_KEY, "projected patch embeddings")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c,
                             model_specific_data={SIZES_KEY: torch.tensor([[h, w]])})
                for c, n, (h, w) in zip(chunks, tokens, sizes)]
