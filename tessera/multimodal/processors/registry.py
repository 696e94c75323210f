"""Architecture name -> multimodal processor class, imported lazily.

Adding a model family is adding one module and one line here; nothing is imported until a
model of that architecture is served.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera.multimodal.processors.base import BaseMultimodalProcessor

__all__ = ["get_processor_class", "architecture_of", "create_processor", "supported_architectures"]

_PROCESSORS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "tessera.multimodal.processors.qwen_vl:QwenVLProcessor",
    "Qwen2_5_VLForConditionalGeneration": "tessera.multimodal.processors.qwen_vl:QwenVLProcessor",
    "Qwen2AudioForConditionalGeneration": "tessera.multimodal.processors.qwen_audio:QwenAudioProcessor",
}

# For configs saved without `architectures` (e.g. a freshly built skeleton config).
_MODEL_TYPES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_PROCESSORS)


def get_processor_class(architecture: str) -> type[BaseMultimodalProcessor]:
    """The processor class for an HF architecture name; ValueError naming it if unsupported."""
    target = _PROCESSORS.get(architecture)
    if target is None:
        raise ValueError(
            f"no multimodal processor for architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def architecture_of(hf_config: Any) -> str:
    """config.architectures[0], or the architecture implied by config.model_type."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"cannot tell the architecture of a config with model_type={model_type!r} "
                     "and no `architectures`")


def create_processor(hf_processor: Any, hf_config: Any, **kwargs: Any) -> BaseMultimodalProcessor:
    """Instantiate the processor for `hf_config`'s architecture (kwargs as BaseMultimodalProcessor)."""
    return get_processor_class(architecture_of(hf_config))(hf_processor, hf_config, **kwargs)
