"""Deferred image preprocessing: images travel as uint8 pixels and become features on the encoder's worker.

Eager preprocessing in the frontend turns a 1536x1024 RGB image (4.5 MiB of uint8) into ~35 MiB of float32
patches, which then cross the frontend -> scheduler socket (and, under tensor parallelism, the broadcast to
every rank). Deferred, the frontend does only the cheap half: decode, hash, and the family's `plan_image`
(placeholder count and model_specific_data from the image size, by the HF processor's own resize rules). The
worker that runs the vision encoder does the expensive half (`DeferredMaterializer`) right before encoding,
with the same HF processor call, on the model's device when that is a GPU.

Contracts:
- An image is deferred only when its pixels are no larger than the features it would become (the eager
  path wins for small images that the processor upscales), and, when the model runs on a CPU, only when
  those features reach DEFER_MIN_FEATURE_BYTES: below that the socket copy is cheaper than moving the
  processor's work onto the worker, whose steps are the serving loop's critical path, while the frontend
  does it on another core (demo-vl's default ~224x224 images, 1.2 MB of features, stay eager). On a GPU the
  worker's half runs on the device, so every image that fits the first rule is deferred.
- Materialised features equal the eager path's exactly on CPU (same processor, same kwargs, the uint8 tensor
  is what the fast processor makes of the PIL image anyway); on a GPU the resize runs there, which moves
  pixel values by float rounding only (bilinear/bicubic kernels differ in the last bits).
- The materialiser checks each item against the frontend's plan (token count, model_specific_data); a
  mismatch is a bug in a plan and fails loudly rather than feeding the model misaligned embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tessera.messages.items import DeferredImage, Modality
from tessera.multimodal.processors.assemble import ItemFeatures

__all__ = ["ImagePlan", "defer_image", "to_chw_uint8", "is_pil_backend",
           "SHAPE_NEUTRAL_KWARGS", "size_field", "DEFER_MIN_FEATURE_BYTES"]

# The server's floor for deferring on a CPU (see the module docstring): below it, the scheduler process's
# extra work costs more than the socket copy it saves, while the large images deferral exists for (~35 MiB of
# features each) are far above it. Figures: docs/benchmarks.md, "Small images stay eager: the deferral floor".
DEFER_MIN_FEATURE_BYTES = 2 << 20

# Image-processor kwargs that change pixel values but never the processed shape: a plan may ignore them.
SHAPE_NEUTRAL_KWARGS = frozenset({"image_mean", "image_std", "do_normalize", "do_rescale", "rescale_factor",
                                  "do_convert_rgb", "resample"})


@dataclass(frozen=True)
class ImagePlan:
    """What the image processor will make of one image, known from its size alone."""

    num_tokens: int
    model_specific_data: Mapping[str, torch.Tensor]
    processed_bytes: int  # bytes of the features the eager path would send


def to_chw_uint8(image: Any) -> torch.Tensor:
    """A decoded PIL image as uint8 [3, H, W] (RGB), the layout the HF fast image processors work in."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()  # np.array: one writable copy


def defer_image(image: Any, plan: ImagePlan, config: dict[str, Any], min_feature_bytes: int = 0
                ) -> ItemFeatures | None:
    """The deferred features of `image`, or None when its pixels would outweigh the processed features or
    those are smaller than `min_feature_bytes` (eager preprocessing then)."""
    if image.width * image.height * 3 > plan.processed_bytes or plan.processed_bytes < min_feature_bytes:
        return None
    return ItemFeatures(Modality.IMAGE, plan.num_tokens, model_specific_data=dict(plan.model_specific_data),
                        deferred=DeferredImage(to_chw_uint8(image), config))


def size_field(value: Any, name: str) -> Any:
    """A key of a size dict, or an attribute of transformers' SizeDict (None when absent)."""
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def is_pil_backend(image_processor: Any) -> bool:
    """Transformers' PIL/numpy image processors may round differently on tensors than on PIL images; only the
    torchvision ("fast") ones are fed deferred pixels."""
    return ".image_processing_pil_" in type(image_processor).__module__ or \
        type(image_processor).__name__.endswith("ImageProcessorPil")
