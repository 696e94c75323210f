"""A request's media after loading, and which of the three input formats it came in."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from tessera.messages.items import Modality
from tessera.multimodal.media import VideoClip

__all__ = ["InputFormat", "LoadedMultimodalData", "as_list"]


class InputFormat(str, enum.Enum):
    RAW = "raw"
    PROCESSOR_OUTPUT = "processor_output"
    PRECOMPUTED_EMBEDDING = "precomputed_embedding"


@dataclass
class LoadedMultimodalData:
    """A request's media after loading. RAW fills images/videos/audios; the two preprocessed
    formats keep the caller's dicts per modality in `preprocessed` (validated, untouched)."""

    input_format: InputFormat = InputFormat.RAW
    images: list[Image.Image] = field(default_factory=list)
    videos: list[VideoClip] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    preprocessed: dict[Modality, list[Mapping[str, Any]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.images or self.videos or self.audios or any(self.preprocessed.values()))

    def raw_counts(self) -> dict[Modality, int]:
        return {Modality.IMAGE: len(self.images), Modality.VIDEO: len(self.videos), Modality.AUDIO: len(self.audios)}

    def subset(self, indices: Sequence[int]) -> LoadedMultimodalData:
        """The raw items at `indices` of the images + videos + audios order, order kept."""
        assert self.input_format is InputFormat.RAW, "only raw media can be split"
        wanted, n_img, n_vid = set(indices), len(self.images), len(self.videos)
        return LoadedMultimodalData(
            InputFormat.RAW,
            images=[x for i, x in enumerate(self.images) if i in wanted],
            videos=[x for i, x in enumerate(self.videos) if n_img + i in wanted],
            audios=[x for i, x in enumerate(self.audios) if n_img + n_vid + i in wanted],
        )


def as_list(data: Any) -> list[Any]:
    """One item or a list/tuple of items, as a list (None: empty)."""
    if data is None:
        return []
    return list(data) if isinstance(data, (list, tuple)) else [data]
