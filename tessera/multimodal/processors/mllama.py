"""Llama-3.2-Vision (Mllama) processor: tiled images the decoder cross-attends to, and a prompt that keeps its
`<|image|>` tokens as ordinary tokens.

The image processor (MllamaImageProcessor) resizes an image onto the best canvas of at most `max_image_tiles`
tiles of `size` pixels and pads it to exactly that many tiles (padding tiles are zero): an item's feature is
[max_image_tiles, C, S, S], with transformers' aspect-ratio id and tile mask (1 for its real tiles) in
model_specific_data. Mllama does not expand placeholders: an item owns no prompt tokens (empty offsets) and
its `<|image|>` token stays in the prompt, embedded like text. Which tokens attend to the image is transformers'
cross-attention mask, computed here from the ids by its own `get_cross_attention_token_mask` and kept per item
as its token span [lo, hi) (hi = -1: to the end, generated tokens included); see tessera/models/mllama.py.

Like HF's MllamaProcessor, a prompt gets the tokenizer's BOS after its leading `<|image|>` tokens when it has
none (`build_string_from_input`). The image processor is called directly (with the kwargs the HF processor
would merge for it), so images can be processed without text (preprocessing-cache misses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.hf_compat import ImageProcessorCall
from tessera.multimodal.processors.split import embedding_chunks

__all__ = ["MllamaProcessor", "cross_attention_spans", "tile_rows"]

# model_specific_data keys (read by tessera/models/mllama.py).
CROSS_SPAN, RATIO_ID, RATIO_MASK = "cross_attention_span", "aspect_ratio_id", "aspect_ratio_mask"


def tile_rows(hf_config: Any) -> tuple[int, int]:
    """(max_num_tiles, vision states per tile): a tile's are its patches plus the class token."""
    vision = hf_config.vision_config
    return int(vision.max_num_tiles), (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1


def cross_attention_spans(input_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """Per `<|image|>` token, in order: the [lo, hi) token span attending to its image, as transformers'
    processor masks it; hi = -1 where the span runs to the end of the prompt (generation repeats the last row,
    so it runs on through every generated token)."""
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    spans = get_cross_attention_token_mask(list(input_ids), image_token_id)
    return [(int(lo), -1 if hi == -1 or hi >= len(input_ids) else int(hi)) for lo, hi in spans]


class MllamaProcessor(ImageProcessorCall, BaseMultimodalProcessor):
    """MllamaForConditionalGeneration (images)."""

    processor_kwargs_class = "transformers.models.mllama.processing_mllama:MllamaProcessorKwargs"
    hashed_image_settings = ("size", "max_image_tiles", "image_mean", "image_std", "resample", "do_convert_rgb")
    tokenizes_text = True  # BOS after the leading `<|image|>` tokens, with or without images

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        vision = hf_config.vision_config
        self.max_tiles, self.rows_per_tile = tile_rows(hf_config)
        self.tile_shape = (int(getattr(vision, "num_channels", 3)), int(vision.image_size), int(vision.image_size))
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        ip = hf_processor.image_processor
        size = ip.size
        side = (int(size["height"]), int(size["width"])) if isinstance(size, Mapping) else (size.height, size.width)
        if side != self.tile_shape[1:] or int(ip.max_image_tiles) != self.max_tiles:
            raise ValueError(f"image processor tiles of {side[0]}x{side[1]}, at most {ip.max_image_tiles}, but the "
                             f"vision config takes {self.tile_shape[1]}-pixel tiles, max_num_tiles={self.max_tiles}")
        self.bos_token = hf_processor.bos_token
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        config_id = getattr(hf_config, "image_token_index", None)
        token_id = self.special_tokens.token_id(Modality.IMAGE)
        if config_id is not None and int(config_id) != token_id:
            raise ValueError(f"image_token_index={config_id} is not the tokenizer's {hf_processor.image_token!r} "
                             f"({token_id})")
        if int(self.hf_kwargs(Modality.IMAGE).get("max_image_tiles", self.max_tiles)) != self.max_tiles:
            raise ValueError(f"mm_process_config image.max_image_tiles must be the vision config's max_num_tiles "
                             f"({self.max_tiles}): the tower's aspect-ratio embeddings are indexed by it")

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt with BOS after its leading `<|image|>` tokens when it has none, as HF's processor writes it."""
        from transformers.models.mllama.processing_mllama import build_string_from_input

        return super().tokenize(build_string_from_input(prompt, self.bos_token, self.hf_processor.image_token))

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Nothing to expand: one `<|image|>` per item, kept as it is."""
        image = self.special_tokens.token_id(Modality.IMAGE)
        found = sum(1 for t in input_ids if t == image)
        if found != len(features):
            raise ValueError(f"input_ids have {found} image tokens ({self.hf_processor.image_token!r}); expected "
                             f"{len(features)} (one per image item)")
        return list(input_ids)

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        """Items own no tokens; each carries the span of tokens attending to it."""
        spans = cross_attention_spans(input_ids, self.special_tokens.token_id(Modality.IMAGE) or 0)
        return [MultimodalDataItem(modality=f.modality, hash=h, offsets=[], feature=f.feature,
                                   precomputed_embedding=f.precomputed_embedding,
                                   model_specific_data={**f.model_specific_data, CROSS_SPAN: torch.tensor(span)})
                for f, h, span in zip(features, hashes, spans, strict=True)]

    # ------------------------------------------------------------ splitting

    def _ratios(self, data: Mapping[str, Any], what: str, num_items: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(aspect_ratio_ids [n], aspect_ratio_mask [n, max_tiles]) of `data`, leading batch dims flattened."""
        for name in ("aspect_ratio_ids", "aspect_ratio_mask"):
            if data.get(name) is None:
                raise ValueError(f"{what} image data needs '{name}'")
        ids = _tensor(data["aspect_ratio_ids"], "aspect_ratio_ids").reshape(-1).to(torch.long)
        mask = _tensor(data["aspect_ratio_mask"], "aspect_ratio_mask").reshape(-1, self.max_tiles).to(torch.long)
        if ids.shape[0] != mask.shape[0] or (num_items is not None and ids.shape[0] != num_items):
            raise ValueError(f"{what} has aspect_ratio_ids for {ids.shape[0]} images and aspect_ratio_mask for "
                             f"{mask.shape[0]}" + ("" if num_items is None else f", expected {num_items}"))
        if bool((ids <= 0).any()) or bool((mask.sum(-1) == 0).any()):
            raise ValueError(f"{what}: aspect_ratio_ids {ids.tolist()} must be positive and every image needs a "
                             f"tile in aspect_ratio_mask")
        return ids, mask

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        """{'pixel_values': [(batch,) images, max_tiles, C, S, S], 'aspect_ratio_ids', 'aspect_ratio_mask'}."""
        if data.get("pixel_values") is None:
            raise ValueError(f"{what} image data needs 'pixel_values'")
        ids, mask = self._ratios(data, what, num_items)
        pixels = _tensor(data["pixel_values"], "pixel_values")
        shape = (self.max_tiles, *self.tile_shape)
        per_image = shape[0] * shape[1] * shape[2] * shape[3]
        if tuple(pixels.shape[-4:]) != shape or not pixels.is_floating_point() or \
                pixels.numel() != ids.shape[0] * per_image:
            raise ValueError(f"{what} pixel_values has shape {tuple(pixels.shape)} ({pixels.dtype}); "
                             f"{ids.shape[0]} images need floating-point [{ids.shape[0]}, {', '.join(map(str, shape))}]")
        pixels = pixels.reshape(-1, *shape).float()
        return [ItemFeatures(Modality.IMAGE, 0, feature=p.clone(),
                             model_specific_data={RATIO_ID: i.clone(), RATIO_MASK: m.clone()})
                for p, i, m in zip(pixels, ids, mask)]

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """{'feature': projected vision states [max_tiles * rows_per_tile, hidden] per image (or all images' rows
        in one tensor), 'aspect_ratio_ids', 'aspect_ratio_mask'}."""
        ids, mask = self._ratios(data, "precomputed_embedding", None)
        rows = [self.max_tiles * self.rows_per_tile] * int(ids.shape[0])
        chunks = embedding_chunks(data, rows, self.embed_dim, "aspect_ratio_ids", "projected vision states")
        return [ItemFeatures(Modality.IMAGE, 0, precomputed_embedding=c,
                             model_specific_data={RATIO_ID: i.clone(), RATIO_MASK: m.clone()})
                for c, i, m in zip(chunks, ids, mask)]
