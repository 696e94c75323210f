"""LLaVA-1.5 and LLaVA-NeXT processors: `<image>` expanded to one token per image feature.

LLaVA-1.5 (HF `LlavaProcessor`): an image is one crop; its item owns that crop's pixels [C, S, S] and
`tokens_per_tile` placeholder tokens (patches, + CLS with the "full" strategy).
LLaVA-NeXT (HF `LlavaNextProcessor`): an image is a base tile + its anyres tiles; the item owns the tiles
[num_tiles, C, S, S] (HF pads every image of a call to the largest tile count; the padding is dropped here),
model_specific_data["image_sizes"] ([1, 2] int64, the original (height, width)), and
`LlavaImageGeometry.num_image_tokens(size)` placeholder tokens: HF's count for every aspect ratio.
Counts and tile counts come from the model config (what the model will produce); the HF processor's own
settings must agree, which the constructor checks.

Caller-supplied formats, per image dict (`format` plus):
- processor_output: `pixel_values` ([N, C, S, S] or [C, S, S]; NeXT: [N, tiles, C, S, S], padded tiles allowed,
  or a list of [tiles, C, S, S]) and, for NeXT, `image_sizes` [N, 2];
- precomputed_embedding: `feature` ([N, tokens, hidden], [tokens, hidden] or a list of [tokens_i, hidden]) and,
  for NeXT, `image_sizes` [N, 2] (each image's rows are checked against its token count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tessera.multimodal.geometry import IMAGE_SIZES_KEY, LlavaImageGeometry
from tessera.multimodal.deferred import SHAPE_NEUTRAL_KWARGS, ImagePlan, is_pil_backend
from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.split import SplitByInputFormat, as_tensors
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["LlavaProcessor", "LlavaNextProcessor"]

# Image-processor settings that shape the pixels (hashed with the content, see feature_kwargs).
_IMAGE_PROCESSOR_FIELDS = ("size", "crop_size", "image_grid_pinpoints", "image_mean", "image_std", "resample",
                           "do_resize", "do_center_crop", "do_pad", "do_rescale", "rescale_factor", "do_normalize",
                           "do_convert_rgb")


class LlavaProcessor(SplitByInputFormat, BaseMultimodalProcessor):
    """LlavaForConditionalGeneration (CLIP/SigLIP tower)."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        self.geometry = LlavaImageGeometry.from_config(hf_config)
        # What the language model and the tower accept, checked on caller-supplied tensors here: a mismatch
        # found in the scheduler process would fail a whole batch.
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        self._check_hf_settings(hf_processor, hf_config)
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        self.hf_kwargs(Modality.IMAGE)  # refuses settings these processors cannot honour, at startup

    def _check_hf_settings(self, hf_processor: Any, hf_config: Any) -> None:
        """The HF processor expands `<image>` by its own settings; they must give the model's counts."""
        g = self.geometry
        patch = getattr(hf_processor, "patch_size", None)
        if patch is not None and int(patch) != g.patch_size:
            raise ValueError(f"processor patch_size {patch} != vision_config.patch_size {g.patch_size}")
        strategy = getattr(hf_processor, "vision_feature_select_strategy", None)
        if strategy is not None and strategy != g.select_strategy:
            raise ValueError(f"processor vision_feature_select_strategy {strategy!r} != the config's "
                             f"{g.select_strategy!r}")
        extra = getattr(hf_processor, "num_additional_image_tokens", None)
        if extra is not None and int(extra) != int(g.has_cls):
            raise ValueError(f"processor num_additional_image_tokens {extra} != {int(g.has_cls)} (the CLS tokens "
                             "of the vision tower)")

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(
            image_token=getattr(self.hf_processor, "image_token", "<image>"),
            image_token_id=getattr(self.hf_config, "image_token_id", None),
        )

    # ------------------------------------------------------------ kwargs

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().hf_kwargs(modality)
        for name in ("max_pixels", "min_pixels"):
            if name in kwargs:
                raise ValueError(f"mm_process_config image {name!r}: {type(self).__name__} resizes images to the "
                                 "vision tower's fixed input size")
        return kwargs

    def feature_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().feature_kwargs(modality)
        image_processor = self.hf_processor.image_processor
        for name in _IMAGE_PROCESSOR_FIELDS:
            kwargs.setdefault(name, getattr(image_processor, name, None))
        return kwargs

    # ------------------------------------------------------------ deferred images

    def _plannable(self) -> bool:
        return not is_pil_backend(self.hf_processor.image_processor) and \
            not set(self.hf_kwargs(Modality.IMAGE)) - SHAPE_NEUTRAL_KWARGS

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """One crop of the tower's input size, whatever the image's size."""
        if not self._plannable():
            return None
        c, s, _ = self._crop_shape()
        return ImagePlan(self.geometry.tokens_per_tile, {}, c * s * s * 4)

    # ------------------------------------------------------------ splitting

    def _crop_shape(self) -> tuple[int, int, int]:
        g = self.geometry
        return g.num_channels, g.image_size, g.image_size

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        pixels = _tensor(data["pixel_values"], "pixel_values")
        if pixels.ndim == 3:
            pixels = pixels[None]
        crop = self._crop_shape()
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != crop or not pixels.is_floating_point():
            raise ValueError(f"pixel_values has shape {tuple(pixels.shape)} ({pixels.dtype}); the vision tower takes "
                             f"floating-point [num_images, {crop[0]}, {crop[1]}, {crop[2]}]")
        n = self.geometry.tokens_per_tile
        return [ItemFeatures(Modality.IMAGE, n, feature=p.clone()) for p in pixels]

    def _embedding_chunks(self, data: Mapping[str, Any]) -> list[torch.Tensor]:
        if data.get("feature") is None:
            raise ValueError("precomputed_embedding image data needs 'feature' (projected image features)")
        chunks = as_tensors(data["feature"], "feature", batch_ndim=3)
        if any(c.ndim != 2 or c.shape[1] != self.embed_dim or not c.is_floating_point() for c in chunks):
            raise ValueError(f"precomputed image features have shapes {[tuple(c.shape) for c in chunks]}; the "
                             f"language model takes floating-point [num_tokens, {self.embed_dim}] per image")
        return chunks

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        chunks = self._embedding_chunks(data)
        n = self.geometry.tokens_per_tile
        if any(c.shape[0] != n for c in chunks):
            raise ValueError(f"precomputed image features have shapes {[tuple(c.shape) for c in chunks]}; each "
                             f"image has {n} tokens")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c.clone()) for c in chunks]


class LlavaNextProcessor(LlavaProcessor):
    """LlavaNextForConditionalGeneration: anyres tiles, unpadding and newlines (token counts as HF's)."""

    def _check_hf_settings(self, hf_processor: Any, hf_config: Any) -> None:
        super()._check_hf_settings(hf_processor, hf_config)
        ours = [list(p) for p in self.geometry.grid_pinpoints or ()]
        theirs = getattr(hf_processor.image_processor, "image_grid_pinpoints", None)
        if theirs is not None and [list(p) for p in theirs] != ours:
            raise ValueError(f"image processor image_grid_pinpoints {theirs} != config.image_grid_pinpoints {ours}")

    def plan_image(self, height: int, width: int) -> ImagePlan | None:
        """The anyres tiles (base + grid) and token count of the model's geometry, which the constructor checked
        against the image processor's pinpoints; image_sizes is the original size, as HF reports it."""
        if not self._plannable():
            return None
        c, s, _ = self._crop_shape()
        size = (height, width)
        return ImagePlan(self.geometry.num_image_tokens(size),
                         {IMAGE_SIZES_KEY: torch.tensor([size], dtype=torch.long)},
                         self.geometry.num_tiles(size) * c * s * s * 4)

    def _sizes(self, data: Mapping[str, Any], count: int, what: str) -> list[tuple[int, int]]:
        if data.get(IMAGE_SIZES_KEY) is None:
            raise ValueError(f"{what} image data needs {IMAGE_SIZES_KEY!r} (each image's original height, width)")
        sizes = _tensor(data[IMAGE_SIZES_KEY], IMAGE_SIZES_KEY).reshape(-1, 2).to(torch.long)
        if sizes.shape[0] != count or bool((sizes <= 0).any()):
            raise ValueError(f"{IMAGE_SIZES_KEY} {sizes.tolist()}: expected {count} positive (height, width) rows")
        return [(int(h), int(w)) for h, w in sizes.tolist()]

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        per_image = as_tensors(data["pixel_values"], "pixel_values", batch_ndim=5)
        crop = self._crop_shape()
        out = []
        for i, (tiles, size) in enumerate(zip(per_image, self._sizes(data, len(per_image), what))):
            need = self.geometry.num_tiles(size)
            if tiles.ndim != 4 or tuple(tiles.shape[1:]) != crop or tiles.shape[0] < need \
                    or not tiles.is_floating_point():
                raise ValueError(f"pixel_values of image {i} (size {size}) have shape {tuple(tiles.shape)} "
                                 f"({tiles.dtype}); expected floating-point [{need}, {crop[0]}, {crop[1]}, {crop[2]}]")
            # clone(): a slice view would drag the whole batch's storage along when the item is sent on.
            out.append(ItemFeatures(Modality.IMAGE, self.geometry.num_image_tokens(size), feature=tiles[:need].clone(),
                                    model_specific_data={IMAGE_SIZES_KEY: torch.tensor([size], dtype=torch.long)}))
        return out

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        chunks = self._embedding_chunks(data)
        sizes = self._sizes(data, len(chunks), "precomputed_embedding")
        out = []
        for chunk, size in zip(chunks, sizes):
            n = self.geometry.num_image_tokens(size)
            if chunk.shape[0] != n:
                raise ValueError(f"precomputed image features of an image of size {size} have {chunk.shape[0]} "
                                 f"rows; it has {n} tokens")
            out.append(ItemFeatures(Modality.IMAGE, n, precomputed_embedding=chunk.clone(),
                                    model_specific_data={IMAGE_SIZES_KEY: torch.tensor([size], dtype=torch.long)}))
        return out
