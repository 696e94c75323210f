"""Llama4Processor against transformers' Llama4Processor (tiles + the global image): ids with the tile/global
layout, patch-run offsets, pixels (HF's bfloat16, as float32); the preprocessing cache; the three input
formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE
from tessera.multimodal.processors.llama4 import Llama4Processor
from tests.models.llama4_testing import SPECS, make_tiny_llama4_checkpoint

from .conftest import chat_text, scene_image
from .processor_checks import (check_cache_hits_and_process_config, check_formats_agree, check_single_image,
                               check_text_only_and_refusals, checkpoint_fixtures)

SPEC = SPECS["gqa_chunked"]  # 28-pixel tiles, 4 tokens per tile


ckpt, make_processor = checkpoint_fixtures(lambda path: make_tiny_llama4_checkpoint(path, SPEC, max_patches=6),
                                           "llama4_proc")


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
    check_single_image(ckpt[0], make_processor, size, lambda o, r: assert_matches_hf(o, r, *ckpt))


def test_two_images_cache_hits_and_process_config(ckpt, make_processor):
    hf_processor, config = ckpt
    images = [scene_image(1, (100, 45)), scene_image(2, (30, 80))]
    check_cache_hits_and_process_config(hf_processor, make_processor,
                                        lambda o, r: assert_matches_hf(o, r, hf_processor, config),
                                        images, [images[0], scene_image(3, (100, 45))], {"max_patches": 2})


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
    check_formats_agree(proc, prompt, images, raw, [processed, precomputed])
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[1])


def test_text_only_and_refusals(ckpt, make_processor):
    check_text_only_and_refusals(ckpt[0], make_processor, {"pixel_values": torch.zeros(2, 3, 32, 32),
                                                           "aspect_ratios": [[1, 2]]}, "pixel_values has shape", None)


def test_deferred_images_match_eager(ckpt, make_processor):
    """The tile grid from the image size alone (the HF processor's own canvas rules), for square, wide and tall
    images; images larger than their tiles take the fallback."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat_text(ckpt[0], ["image", "What is this?"])
    sizes = [(10, 10), (40, 13), (13, 40), (50, 50), (90, 30), (300, 200)]
    assert_deferred_matches_eager(make_processor, prompt, sizes, expect_eager=[(300, 200)])
