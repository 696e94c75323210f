"""The dual encoders' processor (CLIP, SigLIP): a request is a text or one image (each is embedded on its own).

A text is tokenized as the frontend tokenizes any prompt. An image becomes one placeholder token (the text
config's end-of-text id: any id does, the model finds the row by its media placement) whose item holds the
HF image processor's pixel values [1, 3, S, S]; `processor_output` takes `pixel_values`, `precomputed_embedding`
takes the projected image features `feature` [projection_dim] or [1, projection_dim].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.multimodal.hashing import hash_item
from tessera.multimodal.processors.assemble import ItemFeatures, ProcessorOutput
from tessera.multimodal.processors.assemble import as_tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor
from tessera.multimodal.processors.loaded import InputFormat, LoadedMultimodalData
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["CLIPProcessor"]


class CLIPProcessor(BaseMultimodalProcessor):
    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens()  # no placeholder in text: an image request carries no text

    @property
    def placeholder_id(self) -> int:
        text = self.hf_config.text_config
        eos = text.eos_token_id
        return eos if isinstance(eos, int) and 0 <= eos < int(text.vocab_size) else 0

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        pixels = as_tensor(hf_output["pixel_values"], "pixel_values")
        return [ItemFeatures(Modality.IMAGE, 1, feature=p[None]) for p in pixels]

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        if input_format is InputFormat.PROCESSOR_OUTPUT:
            if data.get("pixel_values") is None:
                raise ValueError("image_data: processor_output needs 'pixel_values'")
            pixels = as_tensor(data["pixel_values"], "pixel_values")
            pixels = pixels[None] if pixels.ndim == 3 else pixels
            if pixels.ndim != 4 or pixels.shape[0] != 1:
                raise ValueError(f"image_data: pixel_values must be one image [3, S, S], got {tuple(pixels.shape)}")
            return [ItemFeatures(Modality.IMAGE, 1, feature=pixels)]
        if data.get("feature") is None:
            raise ValueError("image_data: precomputed_embedding needs 'feature'")
        feature = as_tensor(data["feature"], "feature").reshape(1, -1)
        hf = self.hf_config  # CLIP's projection_dim, SigLIP's text head width (ModelConfig.embedding_size)
        width = int(hf.projection_dim) if hasattr(hf, "projection_dim") else int(hf.text_config.projection_size)
        if feature.shape[1] != width:
            raise ValueError(f"image_data: feature must hold {width} values (projection_dim), got {feature.shape[1]}")
        return [ItemFeatures(Modality.IMAGE, 1, precomputed_embedding=feature)]

    def process_and_combine_mm_data(self, prompt: str | None, input_ids: list[int] | None,
                                    loaded: LoadedMultimodalData) -> ProcessorOutput:
        if loaded.is_empty:
            return ProcessorOutput(input_ids=self.tokenize(prompt) if prompt is not None else list(input_ids or []),
                                   mm_inputs=MultimodalInputs(items=[]))
        if prompt or input_ids:
            raise ValueError("prompt: CLIP embeds a text or an image, not both in one input")
        if loaded.input_format is InputFormat.RAW:
            if loaded.videos or loaded.audios:
                raise ValueError("media: CLIP takes images only")
            hf = self.hf_processor.image_processor(images=loaded.images, return_tensors="pt",
                                                   **self.hf_kwargs(Modality.IMAGE))
            features = self.split_hf_output(hf, loaded)
            kwargs = self.feature_kwargs(Modality.IMAGE)
            hashes = [hash_item(image, kwargs) for image in loaded.images]
        else:
            features = [f for m, entries in loaded.preprocessed.items() for entry in entries
                        for f in self.split_preprocessed(m, entry, loaded.input_format)]
            hashes = [hash_item([f.feature, f.precomputed_embedding], {"format": loaded.input_format.value})
                      for f in features]
        if len(features) != 1:
            raise ValueError(f"image_data: CLIP embeds one image per input, got {len(features)}")
        f = features[0]
        item = MultimodalDataItem(Modality.IMAGE, hashes[0], [(0, 1)], feature=f.feature,
                                  precomputed_embedding=f.precomputed_embedding)
        return ProcessorOutput(input_ids=[self.placeholder_id], mm_inputs=MultimodalInputs(items=[item]))
