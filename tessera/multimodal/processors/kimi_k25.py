"""Kimi-K2.5 processor: images at native resolution as 14 x 14 patches, one <|media_pad|> per 2 x 2 block.

transformers' Kimi_K25ImageProcessor shrinks an image (never enlarges it) so that it has at most `max_patches`
patches and at most size["max_height"] pixels a side (navit_resize), pads it up to a multiple of
patch_size * merge_size, and cuts it into patches: pixel_values [h * w, 3, patch, patch] and image_grid_thw
[1, h, w]. The HF processor writes h * w / merge_size^2 <|media_pad|> tokens for the image's single one (the chat
template wraps it in <|media_begin|>image<|media_content|> ... <|media_end|>). An item's `feature` is its
patches, model_specific_data["image_grid_thw"] its [1, 3] grid.

--mm-process-config image kwargs go to the image processor (`max_patches`, `size`, ...); `max_pixels` is read as
a patch budget (max_pixels / patch_size^2 patches, SGLang's and vLLM's name for the same limit); `min_pixels` is
refused: this processor never upscales.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality
from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend, size_field
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.split import SplitByInputFormat, as_tensors, embedding_chunks
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["KimiK25Processor"]

GRID_KEY = "image_grid_thw"
_PLANNED_KWARGS = frozenset({"max_patches", "size", "patch_size", "merge_size"})


class KimiK25Processor(SplitByInputFormat, BaseMultimodalProcessor):
    """Kimi_K25ForConditionalGeneration (images)."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        vision = hf_config.vision_config
        self.patch_size = int(vision.patch_size)
        merge = [int(m) for m in vision.merge_kernel_size]
        ip = hf_processor.image_processor
        if merge[0] != merge[1] or int(ip.merge_size) != merge[0] or int(ip.patch_size) != self.patch_size:
            raise ValueError(f"image processor patch_size={ip.patch_size}, merge_size={ip.merge_size}: the vision "
                             f"tower takes patches of vision_config.patch_size={self.patch_size} merged by "
                             f"vision_config.merge_kernel_size={merge}")
        self.merge = merge[0]
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(image_token=self.hf_processor.image_token,
                                       image_token_id=getattr(self.hf_config, "image_token_id", None))

    # ------------------------------------------------------------ kwargs

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().hf_kwargs(modality)
        if "min_pixels" in kwargs:
            raise ValueError("mm_process_config image 'min_pixels': the Kimi-K2.5 image processor never upscales")
        if "max_pixels" in kwargs:
            kwargs["max_patches"] = max(1, int(kwargs.pop("max_pixels")) // self.patch_size**2)
        return kwargs

    def feature_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().feature_kwargs(modality)
        ip = self.hf_processor.image_processor
        for name in ("size", "max_patches", "patch_size", "merge_size", "image_mean", "image_std", "resample"):
            kwargs.setdefault(name, getattr(ip, name, None))
        return kwargs

    # ------------------------------------------------------------ deferred images

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """The grid navit_resize gives a height x width image (the image processor's own function), padded to whole
        merge blocks."""
        from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

        ip = self.hf_processor.image_processor
        kwargs = self.hf_kwargs(Modality.IMAGE)
        if is_pil_backend(ip) or not getattr(ip, "do_resize", True) \
                or set(kwargs) - _PLANNED_KWARGS - SHAPE_NEUTRAL_KWARGS:
            return None
        size = kwargs.get("size") or ip.size
        side = size_field(size, "max_height")
        if side is None or side != size_field(size, "max_width"):
            return None  # the eager path raises the image processor's own error
        _, (h, w) = navit_resize(height, width, patch_size=self.patch_size, merge_kernel_size=self.merge,
                                 max_patches=int(kwargs.get("max_patches", ip.max_patches)), max_size_per_side=side)
        gh, gw = h // self.patch_size, w // self.patch_size
        return ImagePlan(gh * gw // self.merge**2, {GRID_KEY: torch.tensor([[1, gh, gw]], dtype=torch.long)},
                         gh * gw * 3 * self.patch_size**2 * 4)

    # ------------------------------------------------------------ splitting

    def _grids(self, data: Mapping[str, Any], what: str) -> torch.Tensor:
        if data.get(GRID_KEY) is None:
            raise ValueError(f"{what} image data needs {GRID_KEY!r} ([1, h, w] per image)")
        grids = _tensor(data[GRID_KEY], GRID_KEY).reshape(-1, 3).to(torch.long)
        if grids.shape[0] == 0 or bool((grids[:, 0] != 1).any()) or bool((grids[:, 1:] <= 0).any()) \
                or bool((grids[:, 1:] % self.merge).any()):
            raise ValueError(f"{GRID_KEY} {grids.tolist()}: each image is [1, h, w], h and w positive multiples of "
                             f"merge_size {self.merge}")
        return grids

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """{'pixel_values': [sum of h * w, 3, patch, patch] or a list of [h * w, 3, patch, patch], 'image_grid_thw'}."""
        grids = self._grids(data, what)
        if num_items is not None and grids.shape[0] != num_items:
            raise ValueError(f"{what} has {GRID_KEY} for {grids.shape[0]} images, expected {num_items}")
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        rows = (grids[:, 1] * grids[:, 2]).tolist()
        value = data["pixel_values"]
        chunks = as_tensors(value, "pixel_values") if isinstance(value, (list, tuple)) else None
        if chunks is None:
            pixels = _tensor(value, "pixel_values")
            if pixels.ndim != 4 or pixels.shape[0] != sum(rows):
                raise ValueError(f"pixel_values has shape {tuple(pixels.shape)}; {GRID_KEY} needs {sum(rows)} patches")
            # clone(): a slice would drag the whole batch's storage along when the item is sent on.
            chunks = [pixels] if len(rows) == 1 else [c.clone() for c in pixels.split(rows)]
        want = (3, self.patch_size, self.patch_size)
        if len(chunks) != len(rows) or any(c.ndim != 4 or c.shape[0] != n or tuple(c.shape[1:]) != want
                                           or not c.is_floating_point() for c, n in zip(chunks, rows)):
            raise ValueError(f"pixel_values of shapes {[tuple(c.shape) for c in chunks]}; {GRID_KEY} needs "
                             f"floating-point [{rows}, {', '.join(map(str, want))}] patches")
        return [ItemFeatures(Modality.IMAGE, n // self.merge**2, feature=c,
                             model_specific_data={GRID_KEY: g.view(1, 3).clone()})
                for c, n, g in zip(chunks, rows, grids)]

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """{'feature': [sum of tokens, hidden] or a list, one per image, 'image_grid_thw'}."""
        grids = self._grids(data, "precomputed_embedding")
        tokens = (grids[:, 1] * grids[:, 2] // self.merge**2).tolist()
        chunks = embedding_chunks(data, tokens, self.embed_dim, GRID_KEY, "projected image embeddings")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c,
                             model_specific_data={GRID_KEY: g.view(1, 3).clone()})
                for c, n, g in zip(chunks, tokens, grids)]
