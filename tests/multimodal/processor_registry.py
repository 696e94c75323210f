"""Test helper: architecture -> multimodal processor class, read from the family table (tessera/models/families.py).

Nothing is imported until a model of that architecture is served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.models.families import FAMILIES, architecture_of, family_for_config

if TYPE_CHECKING:
    from tessera.multimodal.processors.base import BaseMultimodalProcessor

__all__ = ["get_processor_class", "architecture_of", "create_processor", "supported_architectures"]


def supported_architectures() -> list[str]:
    """Architectures that take media (those with a processor)."""
    return sorted({f.architecture for f in FAMILIES.values() if f.processor})


def get_processor_class(architecture: str) -> type[BaseMultimodalProcessor]:
    """The processor class for an HF architecture; ValueError naming it if it has none."""
    family = next((f for f in FAMILIES.values() if f.architecture == architecture and f.processor), None)
    cls = family.processor_class() if family is not None else None
    if cls is None:
        raise ValueError(f"no multimodal processor for architecture {architecture!r}; "
                         f"multimodal architectures: {', '.join(supported_architectures())}")
    return cls


def create_processor(hf_processor: Any, hf_config: Any, **kwargs: Any) -> BaseMultimodalProcessor:
    """Instantiate the processor for `hf_config`'s architecture (kwargs as BaseMultimodalProcessor)."""
    cls = family_for_config(hf_config).processor_class()
    if cls is None:
        return get_processor_class(architecture_of(hf_config))  # raises, naming the architecture
    return cls(hf_processor, hf_config, **kwargs)
