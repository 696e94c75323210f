"""InternVLProcessor against transformers' InternVLProcessor (GotOcr2 tiling with a thumbnail): ids, the
<img>/</img>-wrapped placeholder runs, tiles; the preprocessing cache; the three input formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE
from tessera.multimodal.processors.internvl import InternVLProcessor
from tests.models.internvl_testing import SPECS, make_tiny_internvl_checkpoint

from .conftest import chat_text, scene_image
from .processor_checks import (check_cache_hits_and_process_config, check_formats_agree, check_single_image,
                               check_text_only_and_refusals, checkpoint_fixtures)

SPEC = SPECS["qwen2_gqa"]  # 48-pixel tiles, 9 tokens per tile


ckpt, make_processor = checkpoint_fixtures(lambda path: make_tiny_internvl_checkpoint(path, SPEC, max_patches=6),
                                           "internvl_proc")


def assert_matches_hf(out, ref, hf_processor) -> None:
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    assert torch.equal(torch.cat([it.feature for it in items]), ref["pixel_values"])
    context = hf_processor.image_token_id
    assert sum(it.num_tokens for it in items) == out.input_ids.count(context)
    for item in items:
        assert item.num_tokens == item.feature.shape[0] * SPEC.tokens_per_tile
        (s, e), = item.offsets
        assert set(out.input_ids[s:e]) == {context}
        assert out.input_ids[s - 1] == hf_processor.start_image_token_id
        assert out.input_ids[e] == hf_processor.end_image_token_id
        assert item.pad_value >= PAD_VALUE_BASE


def test_registry(ckpt, make_processor):
    assert isinstance(make_processor(), InternVLProcessor)


# (width, height): one tile (square, no thumbnail), wide, tall, extreme, tiny and large.
SIZES = [(48, 48), (140, 40), (40, 150), (500, 30), (20, 20), (333, 251), (97, 260)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(ckpt, make_processor, size):
    check_single_image(ckpt[0], make_processor, size, lambda o, r: assert_matches_hf(o, r, ckpt[0]))


def test_two_images_cache_hits_and_process_config(ckpt, make_processor):
    hf_processor = ckpt[0]
    images = [scene_image(1, (200, 90)), scene_image(2, (60, 180))]
    check_cache_hits_and_process_config(hf_processor, make_processor,
                                        lambda o, r: assert_matches_hf(o, r, hf_processor),
                                        images, [images[0], scene_image(3, (200, 90))], {"max_patches": 2})


def test_three_formats_give_the_same_ids(ckpt, make_processor):
    hf_processor = ckpt[0]
    images = [scene_image(5, (150, 60)), scene_image(6, (48, 48))]
    prompt = chat_text(hf_processor, ["image", "image", "Describe."])
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images)
    ids = raw.input_ids
    tiles = torch.cat([it.feature for it in raw.mm_inputs.items])
    counts = [it.feature.shape[0] for it in raw.mm_inputs.items]
    processed = proc.process(input_ids=ids, image_data=[
        {"format": "processor_output", "pixel_values": tiles, "num_patches": counts}])
    embeds = [torch.randn(n * SPEC.tokens_per_tile, SPEC.hidden) for n in counts]
    precomputed = proc.process(prompt=prompt, image_data=[{"format": "precomputed_embedding", "feature": embeds}])
    check_formats_agree(proc, prompt, images, raw, [processed, precomputed])
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[1])


def test_text_only_and_refusals(ckpt, make_processor):
    check_text_only_and_refusals(ckpt[0], make_processor, {"pixel_values": torch.zeros(2, 3, 32, 32),
                                                           "num_patches": [2]}, "pixel_values has shape", "<video>")


def test_deferred_images_match_eager(ckpt, make_processor):
    """The tile grid from the image size alone (the HF processor's own canvas rules), for square, wide and tall
    images; images larger than their tiles take the fallback."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat_text(ckpt[0], ["image", "What is this?"])
    sizes = [(10, 10), (40, 13), (13, 40), (50, 50), (90, 30), (600, 400)]
    assert_deferred_matches_eager(make_processor, prompt, sizes, expect_eager=[(600, 400)])
