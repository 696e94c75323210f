"""The Transformers backend's processor for any HF processor: its own placeholder expansion, its outputs carried
to the model's feature function.

The HF processor runs over the prompt and all of a request's media in one call, exactly as HF `generate`'s caller
runs it, and its input_ids are the request's (whatever it expands a placeholder into: runs of image tokens with
row and tile markers between them, Idefics3's; a prefix of image tokens and BOS, PaliGemma's). A family's split
of that output into images is not known here, so each modality of a request is ONE item: its feature is the
modality's pixel tensor, its model_specific_data the modality's other outputs (image_sizes,
pixel_attention_mask, batch_num_images, video_grid_thw, ...), which the backend hands to the model's feature
function by name, and its offsets are every run of the modality's placeholder id (the config's), whose rows the
function's output fills in order. The item's hash covers every image (or video) of the request and the processor's kwargs, so the prefix and encoder
caches are shared between requests with the same images in the same order.

Only raw media with a text prompt are taken: the expansion is the HF processor's, and it starts from text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.messages.items import Modality, MultimodalInputs
from tessera.multimodal.hashing import hash_item
from tessera.multimodal.processors.assemble import ItemFeatures, ProcessorOutput, build_items
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.loaded import InputFormat, LoadedMultimodalData
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

# Processor outputs that describe the text, not the media.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
# Per modality: the pixel tensor (the feature function's first argument) and the word its other outputs carry.
_FEATURE_KEYS = {Modality.IMAGE: "pixel_values", Modality.VIDEO: "pixel_values_videos"}


def media_token_id(hf_config: Any, modality: Modality) -> int | None:
    """The id the model scatters a modality's rows into (config.image_token_id / image_token_index, ...)."""
    for name in (f"{modality.value}_token_id", f"{modality.value}_token_index"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


class TransformersProcessor(BaseMultimodalProcessor):
    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        # Videos where the config has a video token and the HF processor a video processor.
        self.supported_modalities = frozenset(
            m for m in _FEATURE_KEYS if media_token_id(hf_config, m) is not None
            and (m is Modality.IMAGE or getattr(hf_processor, "video_processor", None) is not None))
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        # The ids the model scatters rows into, which may not be the prompt's placeholders (Aya Vision's `<image>`
        # becomes runs of `<|IMG_PATCH|>`).
        self.item_tokens = MultimodalSpecialTokens(**{f"{m.value}_token_id": media_token_id(hf_config, m)
                                                      for m in self.supported_modalities}).build(hf_processor)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        """The placeholders the prompt carries: the HF processor's `image_token` / `video_token`, else the ids."""
        tokens: dict[str, Any] = {}
        for m in self.supported_modalities:
            text = getattr(self.hf_processor, f"{m.value}_token", None)
            if text is not None:
                tokens[f"{m.value}_token"] = str(text)
            else:
                tokens[f"{m.value}_token_id"] = media_token_id(self.hf_config, m)
        return MultimodalSpecialTokens(**tokens)

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        """One item per modality given: its pixel tensor and the modality's other outputs."""
        items = []
        for modality, given in ((Modality.IMAGE, loaded.images), (Modality.VIDEO, loaded.videos)):
            if not given:
                continue
            key = _FEATURE_KEYS[modality]
            feature = hf_output.get(key)
            if not isinstance(feature, torch.Tensor):
                raise ValueError(f"{type(self.hf_processor).__name__} returned no {key} tensor")
            video = modality is Modality.VIDEO
            extra = {k: v for k, v in hf_output.items() if isinstance(v, torch.Tensor) and k not in _TEXT_KEYS
                     and k not in _FEATURE_KEYS.values() and ("video" in k) == video}
            num_tokens = int((hf_output["input_ids"] == self.item_tokens.token_id(modality)).sum())
            items.append(ItemFeatures(modality, num_tokens, feature=feature, model_specific_data=extra))
        return items

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
        hashes = [hash_item(loaded.images if f.modality is Modality.IMAGE else [c.frames for c in loaded.videos],
                            self.feature_kwargs(f.modality)) for f in features]
        items = build_items(ids, features, hashes, self.item_tokens)
        return ProcessorOutput(input_ids=ids, mm_inputs=MultimodalInputs(items=items))
