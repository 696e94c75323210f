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

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tessera.multimodal.hashing import kwargs_json
from tessera.multimodal.items import DeferredImage, Modality, MultimodalDataItem
from tessera.multimodal.processors.assemble import ItemFeatures

if TYPE_CHECKING:
    from tessera.multimodal.processors.base import BaseMultimodalProcessor

__all__ = ["ImagePlan", "DeferredMaterializer", "defer_image", "to_chw_uint8", "is_pil_backend",
           "SHAPE_NEUTRAL_KWARGS", "size_field", "DEFER_MIN_FEATURE_BYTES"]

# The server's floor for deferring (see the module docstring). Measured on demo-vl, offline workload a (64
# images resized to ~224x224, 2 cores): deferring them all added 0.17 s of CPU time to the scheduler process
# (2.58 -> 2.75 s) and saved the frontend 0.25 s that it spends in parallel. Issue 17's payload case (four
# 1536x1024 images at max_pixels 1572864: ~35 MiB of features each) is far above it.
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


class DeferredMaterializer:
    """Worker side: deferred items -> ordinary items with features, just before they are encoded.

    `make_processor(image_config)` builds the frontend's processor class for that mm_process_config["image"];
    one instance per distinct config is kept. Items without a deferred payload pass through untouched.
    """

    def __init__(self, make_processor: Callable[[dict[str, Any]], BaseMultimodalProcessor],
                 device: torch.device | None = None) -> None:
        self._make = make_processor
        self._device = str(device) if device is not None and device.type == "cuda" else None
        self._processors: dict[str, BaseMultimodalProcessor] = {}
        self._lock = threading.Lock()
        self.materialized = 0  # images preprocessed here

    def _processor(self, config: dict[str, Any]) -> BaseMultimodalProcessor:
        key = kwargs_json(config)
        with self._lock:
            proc = self._processors.get(key)
            if proc is None:
                proc = self._processors[key] = self._make(config)
                proc.image_device = self._device
            return proc

    def __call__(self, items: Sequence[MultimodalDataItem]) -> list[MultimodalDataItem]:
        out = list(items)
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if item.deferred is not None:
                groups.setdefault(kwargs_json(item.deferred.config), []).append(i)
        for indices in groups.values():
            first = items[indices[0]].deferred
            assert first is not None
            features = self._processor(first.config).materialize_images(
                [items[i].deferred.pixels for i in indices])  # type: ignore[union-attr]
            for i, f in zip(indices, features, strict=True):
                _check_plan(items[i], f)
                # A new item: the scheduler's copy keeps its small payload (it may be encoded again after a
                # retraction or an encoder-cache eviction).
                out[i] = dataclasses.replace(items[i], feature=f.feature, deferred=None)
            self.materialized += len(indices)
        return out


def _check_plan(item: MultimodalDataItem, f: ItemFeatures) -> None:
    same = f.num_tokens == item.num_tokens and all(
        k in f.model_specific_data and torch.equal(v.cpu(), f.model_specific_data[k].cpu())
        for k, v in item.model_specific_data.items())
    if not same:
        planned = {k: v.tolist() for k, v in item.model_specific_data.items()}
        got = {k: v.tolist() for k, v in f.model_specific_data.items()}
        raise ValueError(f"deferred image: the processor made {f.num_tokens} tokens {got}, the frontend planned "
                         f"{item.num_tokens} {planned}")


def materializer_for(processor_path: str, hf_config: Any, processor_class: type | None,
                     device: torch.device | None) -> DeferredMaterializer | None:
    """The materialiser of a served model (None for families without a media processor). The HF processor
    is loaded from `processor_path` on the first deferred image, so text-only traffic never pays for it."""
    if processor_class is None:
        return None
    loaded: list[Any] = []

    def make(image_config: dict[str, Any]) -> BaseMultimodalProcessor:
        if not loaded:
            from transformers import AutoProcessor

            loaded.append(AutoProcessor.from_pretrained(processor_path))
        return processor_class(loaded[0], hf_config, {"image": image_config} if image_config else {})

    return DeferredMaterializer(make, device)
