"""PixtralProcessor against transformers' PixtralProcessor: ids with [IMG] rows closed by [IMG_BREAK] /
[IMG_END], one offset run per row, native-resolution pixels (HF's batch padding cropped off); the preprocessing
cache; the three input formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE
from tessera.multimodal.processors.pixtral import PixtralProcessor
from tests.models.pixtral_testing import SPECS, make_tiny_pixtral_checkpoint

from .conftest import chat_text, scene_image
from .processor_checks import (check_cache_hits_and_process_config, check_formats_agree, check_single_image,
                               check_text_only_and_refusals, checkpoint_fixtures)

SPEC = SPECS["mistral_gqa"]  # 8-pixel patches, longest edge 96


ckpt, make_processor = checkpoint_fixtures(lambda path: make_tiny_pixtral_checkpoint(path, SPEC), "pixtral_proc")


def chat(hf_processor, parts: list[str]) -> str:
    return chat_text(hf_processor, parts, add_generation_prompt=False)


def assert_matches_hf(out, ref, hf_processor) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    sizes = ref["image_sizes"].tolist()
    assert len(items) == len(sizes)
    img, brk, end = hf_processor.image_token_id, hf_processor.image_break_token_id, hf_processor.image_end_token_id
    for item, pixels, (h, w) in zip(items, ref["pixel_values"], sizes):
        assert torch.equal(item.feature, pixels[:, :h, :w])
        assert item.model_specific_data["image_sizes"].tolist() == [[h, w]]
        rows, cols = h // SPEC.patch, w // SPEC.patch
        assert item.num_tokens == rows * cols and len(item.offsets) == rows
        for r, (s, e) in enumerate(item.offsets):
            assert e - s == cols and set(out.input_ids[s:e]) == {img}
            assert out.input_ids[e] == (end if r == rows - 1 else brk)
        assert item.pad_value >= PAD_VALUE_BASE
    assert out.input_ids.count(img) == sum(it.num_tokens for it in items)


def test_registry(make_processor):
    assert isinstance(make_processor(), PixtralProcessor)


# (width, height): square, wide, tall, extreme, tiny, larger than the longest edge, not patch multiples.
SIZES = [(64, 64), (140, 40), (40, 150), (500, 30), (5, 5), (333, 251), (97, 61)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(ckpt, make_processor, size):
    out, proc, img = check_single_image(ckpt[0], make_processor, size, lambda o, r: assert_matches_hf(o, r, ckpt[0]),
                                        chat=chat)
    # Already-expanded ids stay as they are (a one-patch image is a single [IMG] in both forms).
    assert proc.process(input_ids=out.input_ids, image_data=[img]).input_ids == out.input_ids


def test_images_of_different_sizes_cache_hits_and_process_config(ckpt, make_processor):
    """A smaller longest edge from mm_process_config reaches the image processor."""
    hf_processor = ckpt[0]
    images = [scene_image(1, (200, 90)), scene_image(2, (60, 180))]
    check_cache_hits_and_process_config(hf_processor, make_processor,
                                        lambda o, r: assert_matches_hf(o, r, hf_processor),
                                        images, [scene_image(3, (120, 120)), images[1]],
                                        {"size": {"longest_edge": 48}}, chat=chat)


def test_three_formats_give_the_same_ids(ckpt, make_processor):
    hf_processor = ckpt[0]
    images = [scene_image(5, (150, 60)), scene_image(6, (48, 48))]
    prompt = chat(hf_processor, ["image", "image", "Describe."])
    ref = hf_processor(text=[prompt], images=images, return_tensors="pt")
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images)
    ids = raw.input_ids
    processed = proc.process(input_ids=ids, image_data=[{"format": "processor_output", "pixel_values": ref[
        "pixel_values"], "image_sizes": ref["image_sizes"]}])
    counts = [it.num_tokens for it in raw.mm_inputs.items]
    embeds = torch.randn(sum(counts), SPEC.hidden)
    precomputed = proc.process(prompt=prompt, image_data=[
        {"format": "precomputed_embedding", "feature": embeds, "image_sizes": ref["image_sizes"]}])
    check_formats_agree(proc, prompt, images, raw, [processed, precomputed])
    assert all(torch.equal(a.feature, b.feature) for a, b in zip(processed.mm_inputs.items, raw.mm_inputs.items))
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[counts[0]:])


def test_text_only_and_refusals(ckpt, make_processor):
    check_text_only_and_refusals(ckpt[0], make_processor, {"pixel_values": torch.zeros(1, 3, 20, 20),
                                                           "image_sizes": [[20, 20]]}, "multiples of the patch size",
                                 "x", chat=chat)


def test_deferred_images_match_eager(ckpt, make_processor):
    """The capped, patch-aligned size from the image's size, for images under and over the longest edge."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat(ckpt[0], ["image", "What is this?"])
    assert_deferred_matches_eager(make_processor, prompt, [(7, 9), (33, 17), (100, 31), (250, 400)],
                                  expect_eager=[(250, 400)])
