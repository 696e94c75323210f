"""Llama4Processor against transformers' Llama4Processor (tiles + the global image): ids with the tile/global
layout, patch-run offsets, pixels (HF's bfloat16, as float32); the preprocessing cache; the three input
formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE, Modality
from tessera.multimodal.processors.llama4 import Llama4Processor
from tests.models.llama4_testing import SPECS, make_tiny_llama4_checkpoint

from .conftest import (
    chat_text,
    encode_png,
    load_processor_and_config,
    processor_factory,
    scene_image,
)

SPEC = SPECS["gqa_chunked"]  # 28-pixel tiles, 4 tokens per tile


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_proc"), SPEC, max_patches=6)
    return load_processor_and_config(path)


@pytest.fixture
def make_processor(ckpt):
    with processor_factory(*ckpt) as make:
        yield make


def assert_matches_hf(out, ref, hf_processor, config) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    pixels = torch.cat([it.feature for it in items])
    assert ref["pixel_values"].dtype == torch.bfloat16 and pixels.dtype == torch.float32
    assert torch.equal(pixels, ref["pixel_values"].float())
    patch = config.image_token_id
    tok = hf_processor.tokenizer
    assert sum(it.num_tokens for it in items) == out.input_ids.count(patch)
    for item in items:
        num_tiles = item.feature.shape[0]
        rows, cols = item.model_specific_data["aspect_ratio"].tolist()
        assert num_tiles == rows * cols + (rows * cols > 1)
        assert item.num_tokens == num_tiles * SPEC.tokens_per_tile
        assert len(item.offsets) == num_tiles  # one patch run per tile, the global image last
        for s, e in item.offsets:
            assert set(out.input_ids[s:e]) == {patch} and e - s == SPEC.tokens_per_tile
        s, e = item.offsets[-1]
        assert out.input_ids[s - 1] == tok.convert_tokens_to_ids("<|image|>")
        assert out.input_ids[e] == tok.convert_tokens_to_ids("<|image_end|>")
        assert item.pad_value >= PAD_VALUE_BASE


def test_registry(ckpt, make_processor):
    assert isinstance(make_processor(), Llama4Processor)


# (width, height): one tile, wide, tall, extreme, tiny and large.
SIZES = [(28, 28), (90, 40), (40, 120), (300, 20), (10, 12), (170, 130)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(ckpt, make_processor, size):
    hf_processor, config = ckpt
    img = scene_image(sum(size), size)
    prompt = chat_text(hf_processor, ["image", "What is this?"])
    out = make_processor().process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_processor(text=[prompt], images=[img], return_tensors="pt"), hf_processor, config)


def test_two_images_cache_hits_and_process_config(ckpt, make_processor):
    hf_processor, config = ckpt
    images = [scene_image(1, (100, 45)), scene_image(2, (30, 80))]
    prompt = chat_text(hf_processor, ["image", "Compare with", "image", "now."])
    ref = hf_processor(text=[prompt], images=images, return_tensors="pt")
    proc = make_processor(cache_size_bytes=1 << 26)
    first = proc.process(prompt=prompt, image_data=images)
    assert_matches_hf(first, ref, hf_processor, config)
    again = proc.process(prompt=prompt, image_data=images)
    partly = proc.process(prompt=prompt, image_data=[images[0], scene_image(3, (100, 45))])
    assert proc.preprocess_cache_hits == 3
    assert again.input_ids == first.input_ids
    assert [i.hash for i in again.mm_inputs.items] == [i.hash for i in first.mm_inputs.items]
    assert_matches_hf(partly, hf_processor(text=[prompt], images=[images[0], scene_image(3, (100, 45))],
                                           return_tensors="pt"), hf_processor, config)
    fewer = make_processor(mm_process_config={"image": {"max_patches": 2}}).process(prompt=prompt, image_data=images)
    assert_matches_hf(fewer, hf_processor(text=[prompt], images=images, images_kwargs={"max_patches": 2},
                                          return_tensors="pt"), hf_processor, config)
    assert len(fewer.input_ids) < len(first.input_ids)
    assert fewer.mm_inputs.items[0].hash != first.mm_inputs.items[0].hash


def test_three_formats_give_the_same_ids(ckpt, make_processor):
    hf_processor, _ = ckpt
    images = [scene_image(5, (75, 30)), scene_image(6, (28, 28))]
    prompt = chat_text(hf_processor, ["image", "image", "Describe."])
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images)
    ids = raw.input_ids
    tiles = torch.cat([it.feature for it in raw.mm_inputs.items])
    ratios = torch.stack([it.model_specific_data["aspect_ratio"] for it in raw.mm_inputs.items])
    processed = proc.process(input_ids=ids, image_data=[
        {"format": "processor_output", "pixel_values": tiles, "aspect_ratios": ratios}])
    embeds = [torch.randn(it.num_tokens, SPEC.hidden) for it in raw.mm_inputs.items]
    precomputed = proc.process(prompt=prompt, image_data=[
        {"format": "precomputed_embedding", "feature": embeds, "aspect_ratios": ratios}])
    from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=images)  # one placeholder per image
    for out in (processed, precomputed, from_ids):
        assert out.input_ids == ids
        assert [i.offsets for i in out.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[1])


def test_text_only_and_refusals(ckpt, make_processor):
    hf_processor, _ = ckpt
    proc = make_processor(limit_mm_per_request={"image": 1})
    assert proc.process(prompt="hello there").input_ids == hf_processor.tokenizer("hello there")["input_ids"]
    img = scene_image(7, (64, 64))
    with pytest.raises(ValueError, match="too many image items"):
        proc.process(prompt=chat_text(hf_processor, ["image", "image", "?"]), image_data=[img, img])
    with pytest.raises(ValueError, match="image placeholder"):
        proc.process(prompt=chat_text(hf_processor, ["image", "image", "?"]), image_data=[img])
    with pytest.raises(ValueError, match="pixel_values has shape"):
        proc.process(prompt=chat_text(hf_processor, ["image", "?"]), image_data=[
            {"format": "processor_output", "pixel_values": torch.zeros(2, 3, 32, 32), "aspect_ratios": [[1, 2]]}])
    assert Modality.IMAGE in proc.supported_modalities


def test_deferred_images_match_eager(ckpt, make_processor):
    """The tile grid from the image size alone (the HF processor's own canvas rules), for square, wide and tall
    images; images larger than their tiles take the fallback."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat_text(ckpt[0], ["image", "What is this?"])
    sizes = [(10, 10), (40, 13), (13, 40), (50, 50), (90, 30), (300, 200)]
    assert_deferred_matches_eager(make_processor, prompt, sizes, expect_eager=[(300, 200)])
