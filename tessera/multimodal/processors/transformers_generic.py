"""The Transformers backend's processor for any HF processor: its own placeholder expansion, its outputs carried
to the model's feature function.

The HF processor runs over the prompt and all of a request's media in one call, exactly as HF `generate`'s caller
runs it, and its input_ids are the request's (whatever it expands a placeholder into: runs of image tokens with
row and tile markers between them, Idefics3's; a prefix of image tokens and BOS, PaliGemma's). A family's split
of that output into images is not known here, so each modality of a request is ONE item: its feature is the
modality's pixel tensor, its model_specific_data the modality's other outputs (image_sizes,
pixel_attention_mask, batch_num_images, ...), which the backend hands to the model's feature function by name,
and its offsets are every run of the modality's placeholder id, whose rows the function's output fills in
order. The item's hash covers every image of the request and the processor's kwargs, so the prefix and encoder
caches are shared between requests with the same images in the same order.

Only raw media with a text prompt are taken: the expansion is the HF processor's, and it starts from text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality, MultimodalInputs
from tessera.multimodal.hashing import hash_item
from tessera.multimodal.processors.assemble import ItemFeatures, ProcessorOutput, build_items
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.loaded import InputFormat, LoadedMultimodalData
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

# Processor outputs that describe the text, not the media.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
# The pixel tensor of each modality (the feature function's first argument).
_FEATURE_KEYS = {Modality.IMAGE: "pixel_values", Modality.VIDEO: "pixel_values_videos"}


class TransformersProcessor(BaseMultimodalProcessor):
    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        # The id the model scatters image rows into, which may not be the prompt's placeholder (Aya Vision's
        # `<image>` becomes runs of `<|IMG_PATCH|>`): the config's id where it gives one.
        token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_index", None)
        self.item_tokens = (MultimodalSpecialTokens(image_token_id=int(token_id)) if token_id is not None
                            else MultimodalSpecialTokens(image_token=self.special_tokens.image_token)).build(hf_processor)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        """The placeholder the prompt carries: the HF processor's `image_token`, else the config's id."""
        token = getattr(self.hf_processor, "image_token", None)
        if token is not None:
            return MultimodalSpecialTokens(image_token=str(token))
        token_id = getattr(self.hf_config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(self.hf_config, "image_token_index", None)
        if token_id is None:
            raise ValueError(f"{type(self.hf_processor).__name__} names no image token and the config no "
                             "image_token_id: the Transformers backend cannot find the image placeholders")
        return MultimodalSpecialTokens(image_token_id=int(token_id))

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        """One item per modality given (images only here): its pixel tensor and the other media outputs."""
        if not loaded.images:
            return []
        feature = hf_output.get(_FEATURE_KEYS[Modality.IMAGE])
        if not isinstance(feature, torch.Tensor):
            raise ValueError(f"{type(self.hf_processor).__name__} returned no pixel_values tensor")
        extra = {k: v for k, v in hf_output.items()
                 if k not in _TEXT_KEYS and k != "pixel_values" and "video" not in k and isinstance(v, torch.Tensor)}
        image_id = self.item_tokens.image_token_id
        ids = hf_output["input_ids"]
        num_tokens = int((ids == image_id).sum()) if isinstance(ids, torch.Tensor) else 0
        return [ItemFeatures(Modality.IMAGE, num_tokens, feature=feature, model_specific_data=extra)]

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        raise ValueError(f"{modality.value}: the Transformers backend takes raw media only, not {input_format.value}")

    def process_and_combine_mm_data(self, prompt: str | None, input_ids: list[int] | None,
                                    loaded: LoadedMultimodalData) -> ProcessorOutput:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if loaded.is_empty:
            if prompt is not None:
                self.special_tokens.check_counts(prompt, {})
            ids = self.tokenize(prompt) if prompt is not None else list(input_ids or [])
            return ProcessorOutput(input_ids=ids, mm_inputs=MultimodalInputs(items=[]))
        if loaded.input_format is not InputFormat.RAW:
            raise ValueError(f"media: the Transformers backend takes raw media only, not {loaded.input_format.value}")
        if prompt is None:
            raise ValueError("input_ids: with media, the Transformers backend needs the prompt as text (the HF "
                             "processor expands its placeholders)")
        hf_output = self.call_hf_processor(prompt, loaded)
        ids = [int(t) for t in hf_output["input_ids"][0].tolist()]
        features = self.split_hf_output(hf_output, loaded)
        hashes = [hash_item(loaded.images, self.feature_kwargs(Modality.IMAGE))]
        items = build_items(ids, features, hashes, self.item_tokens)
        return ProcessorOutput(input_ids=ids, mm_inputs=MultimodalInputs(items=items))
