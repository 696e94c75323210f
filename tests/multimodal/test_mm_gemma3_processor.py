"""Gemma3Processor against HF's Gemma3Processor: input_ids, image-token runs and pixel values, pan-and-scan off
and on, from the HF call, from the preprocessing cache and from given input_ids; the other input formats; and
the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.models.families import get_family
from tessera.multimodal.processors.gemma3 import Gemma3Processor
from tests.models.gemma3_testing import SPECS, make_tiny_gemma3_checkpoint

from .conftest import chat_text, processor_factory

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
SPEC = SPECS["mha_softcap"]  # 9 tokens per image, 42 px


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_processor"), SPEC)


@pytest.fixture(scope="module")
def hf_processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture()
def make(checkpoint, hf_processor):
    from transformers import AutoConfig

    with processor_factory(hf_processor, AutoConfig.from_pretrained(checkpoint)) as factory:
        yield factory


def image(h: int, w: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompt(hf_processor, num_images: int, text: str = "What is this?") -> str:
    return chat_text(hf_processor, ["image"] * num_images + [text])


def assert_matches_hf(out, ref, crops: list[int], soft_id: int) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    assert [int(i.model_specific_data["num_crops"]) for i in items] == crops
    assert torch.equal(torch.cat([i.feature for i in items]), ref["pixel_values"])
    type_ids = ref["token_type_ids"][0]
    for item, c in zip(items, crops):
        assert item.num_tokens == (1 + c) * SPEC.tokens_per_image and len(item.offsets) == 1 + c
        for s, e in item.offsets:
            assert set(out.input_ids[s:e]) == {soft_id} and bool(type_ids[s:e].all())
    # Every image token is covered by exactly one item run (the model's bidirectional spans).
    covered = sorted(p for item in items for s, e in item.offsets for p in range(s, e))
    assert covered == torch.nonzero(type_ids).flatten().tolist()


def test_registry_and_family(checkpoint):
    from transformers import AutoConfig

    family = get_family("Gemma3ForConditionalGeneration")
    assert family.bidirectional_mm_spans and family.processor_class() is Gemma3Processor
    assert AutoConfig.from_pretrained(checkpoint).architectures == ["Gemma3ForConditionalGeneration"]


@pytest.mark.parametrize("images_kwargs,sizes,crops", [
    ({}, [(40, 120)], [0]),
    ({}, [(64, 64), (90, 30)], [0, 0]),
    (PAN_AND_SCAN, [(40, 120)], [3]),  # wide: crops side by side
    (PAN_AND_SCAN, [(64, 64), (90, 36), (30, 50)], [0, 3, 2]),  # square: none; tall: stacked; 1.67: two
])
def test_parity_with_hf(make, hf_processor, images_kwargs, sizes, crops):
    proc = make(mm_process_config={"image": images_kwargs}, cache_size_bytes=1 << 26)
    images = [image(h, w, i) for i, (h, w) in enumerate(sizes)]
    text = prompt(hf_processor, len(images))
    ref = hf_processor(text=[text], images=images, return_tensors="pt", images_kwargs=images_kwargs)
    soft_id = hf_processor.tokenizer.image_token_id
    first = proc.process(prompt=text, image_data=images)
    assert_matches_hf(first, ref, crops, soft_id)
    assert proc.preprocess_cache_hits == 0
    again = proc.process(prompt=text, image_data=images)  # features from the cache, ids expanded here
    assert proc.preprocess_cache_hits == len(images)
    assert_matches_hf(again, ref, crops, soft_id)
    from_ids = proc.process(input_ids=hf_processor.tokenizer(text)["input_ids"], image_data=images)
    assert_matches_hf(from_ids, ref, crops, soft_id)


def test_text_only(make, hf_processor):
    text = prompt(hf_processor, 0, "Hello")
    out = make().process(prompt=text)
    assert out.input_ids == hf_processor(text=[text], return_tensors="pt")["input_ids"][0].tolist()
    assert out.mm_inputs.items == []


def test_other_input_formats_give_the_same_ids(make, hf_processor):
    images = [image(40, 120, 1), image(64, 64, 2)]
    text = prompt(hf_processor, 2)
    proc = make(mm_process_config={"image": PAN_AND_SCAN})
    raw = proc.process(prompt=text, image_data=images)
    pixels = torch.cat([i.feature for i in raw.mm_inputs.items])
    crops = [int(i.model_specific_data["num_crops"]) for i in raw.mm_inputs.items]
    as_output = proc.process(prompt=text, image_data=[{"format": "processor_output", "pixel_values": pixels,
                                                       "num_crops": crops}])
    assert as_output.input_ids == raw.input_ids
    assert [i.offsets for i in as_output.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]
    assert torch.equal(torch.cat([i.feature for i in as_output.mm_inputs.items]), pixels)
    rows = sum((1 + c) * SPEC.tokens_per_image for c in crops)
    feature = torch.randn(rows, SPEC.hidden)
    as_embedding = proc.process(prompt=text, image_data=[{"format": "precomputed_embedding", "feature": list(
        feature.split([(1 + c) * SPEC.tokens_per_image for c in crops])), "num_crops": crops}])
    assert as_embedding.input_ids == raw.input_ids
    assert torch.equal(torch.cat([i.precomputed_embedding for i in as_embedding.mm_inputs.items]), feature)


def test_refusals(make, hf_processor):
    proc = make()
    with pytest.raises(ValueError, match="image"):
        proc.process(prompt=prompt(hf_processor, 2), image_data=[image(40, 40)])
    with pytest.raises(ValueError, match="placeholder"):
        proc.process(prompt="no placeholder here", image_data=[image(40, 40)])
    with pytest.raises(ValueError, match="video"):
        proc.process(prompt=prompt(hf_processor, 0), video_data=[[image(40, 40)] * 2])
    with pytest.raises(ValueError, match="pixel_values"):
        proc.process(prompt=prompt(hf_processor, 1), image_data=[{"format": "processor_output",
                                                                  "pixel_values": torch.zeros(1, 3, 8, 8)}])
    with pytest.raises(ValueError, match="precomputed"):
        proc.process(prompt=prompt(hf_processor, 1), image_data=[{"format": "precomputed_embedding",
                                                                  "feature": torch.zeros(5, SPEC.hidden)}])


def test_deferred_images_match_eager(make, hf_processor):
    """One square crop per image; with pan-and-scan, the crop count of wide, tall and square images."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    assert_deferred_matches_eager(make, prompt(hf_processor, 1), [(10, 12), (40, 25), (300, 200)],
                                  expect_eager=[(300, 200)])
    pan = {"image": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8,
                     "pan_and_scan_min_ratio_to_activate": 1.2}}
    assert_deferred_matches_eager(make, prompt(hf_processor, 1), [(60, 20), (20, 70), (30, 30), (33, 9)],
                                  process_config=pan)
