"""Deferred vs eager preprocessing of one family's processor: the same ids, hashes, model_specific_data and
positions from the image size alone, and, once the worker materialises the pixels, bit-identical features."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from tessera.multimodal.materialize import DeferredMaterializer


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Noise, so that any resampling difference shows in the features."""
    rng = np.random.default_rng(seed + 7 * width + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def assert_deferred_matches_eager(make: Callable[..., Any], prompt: str, sizes: Sequence[tuple[int, int]],
                                  process_config: dict | None = None, expect_eager: Sequence[tuple[int, int]] = ()
                                  ) -> None:
    """For each (width, height), one image through `prompt` (one image placeholder), deferred and eager.
    Sizes in `expect_eager` must take the fallback (pixels larger than the features); all others must defer."""
    config = process_config or {}
    deferred, eager = make(defer_images=True, mm_process_config=config), make(mm_process_config=config)
    made_configs: list[dict] = []

    def processor_for(image_config: dict) -> Any:
        made_configs.append(image_config)
        proc = make(mm_process_config={"image": image_config} if image_config else {})
        # What the materialiser does on a GPU, with the CPU: the HF processor must take the `device` kwarg.
        proc.image_device = "cpu"
        return proc

    materialize = DeferredMaterializer(processor_for)
    for width, height in sizes:
        image = noise_image(width, height)
        d = deferred.process(prompt=prompt, image_data=[image])
        e = eager.process(prompt=prompt, image_data=[image])
        (di,), (ei,) = d.mm_inputs.items, e.mm_inputs.items
        assert d.input_ids == e.input_ids, (width, height)
        assert di.hash == ei.hash and di.offsets == ei.offsets, (width, height)
        assert di.model_specific_data.keys() == ei.model_specific_data.keys()
        for k, v in ei.model_specific_data.items():
            assert torch.equal(di.model_specific_data[k], v), (width, height, k)
        if e.mm_inputs.mrope_positions is not None:
            assert torch.equal(d.mm_inputs.mrope_positions, e.mm_inputs.mrope_positions)
            assert d.mm_inputs.mrope_position_delta == e.mm_inputs.mrope_position_delta
        if (width, height) in expect_eager:
            assert di.deferred is None and torch.equal(di.feature, ei.feature), (width, height)
            continue
        assert di.deferred is not None and di.feature is None, (width, height)
        assert di.deferred.pixels.dtype == torch.uint8 and tuple(di.deferred.pixels.shape) == (3, height, width)
        assert di.transport_bytes <= ei.transport_bytes
        (mi,) = materialize([di])
        assert mi.deferred is None and di.deferred is not None  # the original keeps its small payload
        assert mi.feature.dtype == ei.feature.dtype and torch.equal(mi.feature, ei.feature), (width, height)
    assert all(c == config.get("image", {}) for c in made_configs)
