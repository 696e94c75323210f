"""KimiK25Processor against transformers' Kimi_K25Processor: ids with one <|media_pad|> per merged 2 x 2 patch
block inside <|media_begin|>image<|media_content|> ... <|media_end|>, each image's own patches and grid; the
preprocessing cache and mm_process_config; the three input formats; refusals; deferred images."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE
from tessera.multimodal.processors.kimi_k25 import KimiK25Processor
from tests.models.kimi_k25_testing import GRID_KEY, PATCH, SPECS, make_tiny_kimi_checkpoint

from .conftest import scene_image
from .processor_checks import (check_cache_hits_and_process_config, check_formats_agree, check_single_image,
                               check_text_only_and_refusals, checkpoint_fixtures)

SPEC = SPECS["yarn_qlora"]
ckpt, make_processor = checkpoint_fixtures(lambda path: make_tiny_kimi_checkpoint(path, SPEC), "kimi_proc")


def assert_matches_hf(out, ref) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    grids = ref[GRID_KEY]
    rows = (grids[:, 1] * grids[:, 2]).tolist()
    assert len(items) == len(rows)
    for item, pixels, grid, n in zip(items, ref["pixel_values"].split(rows), grids, rows):
        assert torch.equal(item.feature, pixels) and item.model_specific_data[GRID_KEY].tolist() == [grid.tolist()]
        assert item.num_tokens == n // 4 and len(item.offsets) == 1
        s, e = item.offsets[0]
        assert e - s == n // 4 and item.pad_value >= PAD_VALUE_BASE


def test_registry(make_processor):
    assert isinstance(make_processor(), KimiK25Processor)


# (width, height): square, wide, tall, extreme, tiny, over the side and patch budgets, not patch multiples.
SIZES = [(56, 56), (140, 40), (40, 150), (500, 30), (5, 5), (333, 251), (97, 61)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(ckpt, make_processor, size):
    out, proc, img = check_single_image(ckpt[0], make_processor, size, assert_matches_hf)
    assert proc.process(input_ids=out.input_ids, image_data=[img]).input_ids == out.input_ids  # already expanded


def test_images_of_different_sizes_cache_hits_and_process_config(ckpt, make_processor):
    """A smaller patch budget from mm_process_config reaches the image processor."""
    images = [scene_image(1, (200, 90)), scene_image(2, (60, 180))]
    check_cache_hits_and_process_config(ckpt[0], make_processor, assert_matches_hf, images,
                                        [scene_image(3, (120, 120)), images[1]], {"max_patches": 12})


def test_max_pixels_is_a_patch_budget(ckpt, make_processor):
    prompt = ckpt[0].apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    image = scene_image(4, (300, 200))
    out = make_processor(mm_process_config={"image": {"max_pixels": 12 * PATCH**2}}).process(prompt=prompt,
                                                                                          image_data=[image])
    assert_matches_hf(out, ckpt[0](text=[prompt], images=[image], images_kwargs={"max_patches": 12},
                                   return_tensors="pt"))
    with pytest.raises(ValueError, match="min_pixels"):
        make_processor(mm_process_config={"image": {"min_pixels": 100}}).process(prompt=prompt, image_data=[image])


def test_three_formats_give_the_same_ids(ckpt, make_processor):
    hf_processor = ckpt[0]
    images = [scene_image(5, (150, 60)), scene_image(6, (48, 48))]
    prompt = hf_processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Describe."}]}], tokenize=False)
    ref = hf_processor(text=[prompt], images=images, return_tensors="pt")
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images)
    processed = proc.process(input_ids=raw.input_ids, image_data=[
        {"format": "processor_output", "pixel_values": ref["pixel_values"], GRID_KEY: ref[GRID_KEY]}])
    counts = [it.num_tokens for it in raw.mm_inputs.items]
    embeds = torch.randn(sum(counts), SPEC.hidden)
    precomputed = proc.process(prompt=prompt, image_data=[
        {"format": "precomputed_embedding", "feature": embeds, GRID_KEY: ref[GRID_KEY]}])
    check_formats_agree(proc, prompt, images, raw, [processed, precomputed])
    assert all(torch.equal(a.feature, b.feature) for a, b in zip(processed.mm_inputs.items, raw.mm_inputs.items))
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[counts[0]:])


def test_text_only_and_refusals(ckpt, make_processor):
    check_text_only_and_refusals(ckpt[0], make_processor, {"pixel_values": torch.zeros(4, 3, PATCH, PATCH),
                                                           GRID_KEY: [[1, 1, 4]]}, "multiples of merge_size", "x")


def test_deferred_images_match_eager(ckpt, make_processor):
    """The grid from the image's size alone (navit_resize), for images under and over the side and patch budgets;
    one shrunk so far that its pixels outweigh its patches stays eager."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = ckpt[0].apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], tokenize=False)
    assert_deferred_matches_eager(make_processor, prompt, [(7, 9), (33, 17), (100, 31), (250, 400)],
                                  expect_eager=[(250, 400)])
    assert_deferred_matches_eager(make_processor, prompt, [(90, 60)], process_config={"image": {"max_patches": 8}})
