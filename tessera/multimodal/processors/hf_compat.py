"""Calls into transformers' processors: the kwargs merge (which changed shape within the 5.x versions Tessera
supports), and the image-processor-first call that several processors share."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality
from tessera.multimodal.processors.split import SplitByInputFormat
from tessera.multimodal.special_tokens import MultimodalSpecialTokens


def merge_processor_kwargs(hf_processor: Any, kwargs_class: str, **kwargs: Any) -> dict[str, dict]:
    """hf_processor._merge_kwargs(...): its defaults, the saved settings, then `kwargs`. Transformers < 5.23
    needs the processor's kwargs class ("module:Class") as the first argument; 5.23+ deprecate those
    classes (5.29 removes them) and read the processor's own."""
    module_name, class_name = kwargs_class.split(":")
    cls = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            pass
    init_kwargs = hf_processor.tokenizer.init_kwargs
    if cls is None:
        return hf_processor._merge_kwargs(tokenizer_init_kwargs=init_kwargs, **kwargs)
    return hf_processor._merge_kwargs(cls, tokenizer_init_kwargs=init_kwargs, **kwargs)


class ImageProcessorCall(SplitByInputFormat):
    """Mixin for a BaseMultimodalProcessor that runs the HF image processor itself, with the kwargs the HF
    processor would merge (its defaults, the saved settings, then the request's), and tokenizes the prompt
    unexpanded: the subclass's expand_placeholders then lays out the image tokens exactly as HF's text
    replacement does. (InternVL's processor refuses calls without text, and cache misses need exactly that.)"""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE})
    processor_kwargs_class: ClassVar[str]  # "module:Class" of the HF processor's kwargs (see merge_processor_kwargs)
    # Image-processor settings that shape the features: hashed with each item (a changed setting is a new item).
    hashed_image_settings: ClassVar[tuple[str, ...]] = ()
    hf_processor: Any
    hf_config: Any

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(image_token=self.hf_processor.image_token,
                                       image_token_id=getattr(self.hf_config, "image_token_id", None))

    def extra_image_kwargs(self) -> dict[str, Any]:
        return {}

    def feature_kwargs(self, modality: Any) -> dict[str, Any]:
        kwargs = super().feature_kwargs(modality)  # type: ignore[misc]
        kwargs.update(self.extra_image_kwargs())
        ip = self.hf_processor.image_processor
        for name in self.hashed_image_settings:
            kwargs.setdefault(name, getattr(ip, name, None))
        return kwargs

    def image_processor_kwargs(self) -> dict[str, Any]:
        merged = merge_processor_kwargs(self.hf_processor, self.processor_kwargs_class,
                                        images_kwargs=self.hf_kwargs(Modality.IMAGE))  # type: ignore[attr-defined]
        return {**merged["images_kwargs"], **self.extra_image_kwargs(), "return_tensors": "pt"}

    def call_hf_processor(self, prompt: str | None, loaded: Any) -> Mapping[str, Any]:
        """All images in one image-processor call, and the prompt's unexpanded ids."""
        out = dict(self.hf_processor.image_processor(loaded.images, **self.image_processor_kwargs(),
                                                     **self.image_call_kwargs()))  # type: ignore[attr-defined]
        if prompt is not None:
            out["input_ids"] = torch.tensor([self.tokenize(prompt)])  # type: ignore[attr-defined]
        return out
