"""Architecture -> multimodal processor class, read from the family table (tessera/models/families.py).

Nothing is imported until a model of that architecture is served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.models.families import FAMILIES, architecture_of

if TYPE_CHECKING:
    from tessera.multimodal.processors.base import BaseMultimodalProcessor

__all__ = ["get_processor_class", "architecture_of", "create_processor", "supported_architectures"]


def supported_architectures() -> list[str]:
    """Architectures that take media (those with a processor)."""
    return sorted(a for a, f in FAMILIES.items() if f.processor)


def get_processor_class(architecture: str) -> type[BaseMultimodalProcessor]:
    """The processor class for an HF architecture; ValueError naming it if it has none."""
    family = FAMILIES.get(architecture)
    cls = family.processor_class() if family is not None else None
    if cls is None:
        raise ValueError(f"no multimodal processor for architecture {architecture!r}; "
                         f"multimodal architectures: {', '.join(supported_architectures())}")
    return cls


def create_processor(hf_processor: Any, hf_config: Any, **kwargs: Any) -> BaseMultimodalProcessor:
    """Instantiate the processor for `hf_config`'s architecture (kwargs as BaseMultimodalProcessor)."""
    return get_processor_class(architecture_of(hf_config))(hf_processor, hf_config, **kwargs)
