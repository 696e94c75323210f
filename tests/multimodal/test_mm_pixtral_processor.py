"""PixtralProcessor against transformers' PixtralProcessor: ids with [IMG] rows closed by [IMG_BREAK] /
[IMG_END], one offset run per row, native-resolution pixels (HF's batch padding cropped off); the preprocessing
cache; the three input formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE
from tessera.multimodal.processors.pixtral import PixtralProcessor
from tests.models.pixtral_testing import SPECS, make_tiny_pixtral_checkpoint

from .conftest import (
    chat_text,
    encode_png,
    load_processor_and_config,
    processor_factory,
    scene_image,
)

SPEC = SPECS["mistral_gqa"]  # 8-pixel patches, longest edge 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_pixtral_checkpoint(tmp_path_factory.mktemp("pixtral_proc"), SPEC)
    return load_processor_and_config(path)


@pytest.fixture
def make_processor(ckpt):
    with processor_factory(*ckpt) as make:
        yield make


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
    hf_processor = ckpt[0]
    img = scene_image(sum(size), size)
    prompt = chat(hf_processor, ["image", "What is this?"])
    proc = make_processor()
    out = proc.process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_processor(text=[prompt], images=[img], return_tensors="pt"), hf_processor)
    # Already-expanded ids stay as they are (a one-patch image is a single [IMG] in both forms).
    assert proc.process(input_ids=out.input_ids, image_data=[img]).input_ids == out.input_ids


def test_images_of_different_sizes_cache_hits_and_process_config(ckpt, make_processor):
    hf_processor = ckpt[0]
    images = [scene_image(1, (200, 90)), scene_image(2, (60, 180))]
    prompt = chat(hf_processor, ["image", "Compare with", "image", "now."])
    proc = make_processor(cache_size_bytes=1 << 26)
    first = proc.process(prompt=prompt, image_data=images)
    assert_matches_hf(first, hf_processor(text=[prompt], images=images, return_tensors="pt"), hf_processor)
    again = proc.process(prompt=prompt, image_data=images)  # both from the preprocessing cache
    third = scene_image(3, (120, 120))
    partly = proc.process(prompt=prompt, image_data=[third, images[1]])  # one miss, one hit
    assert proc.preprocess_cache_hits == 3
    assert again.input_ids == first.input_ids
    assert [i.hash for i in again.mm_inputs.items] == [i.hash for i in first.mm_inputs.items]
    assert_matches_hf(partly, hf_processor(text=[prompt], images=[third, images[1]], return_tensors="pt"),
                      hf_processor)
    # A smaller longest edge from mm_process_config reaches the image processor (and the hash).
    small = {"size": {"longest_edge": 48}}
    fewer = make_processor(mm_process_config={"image": small}).process(prompt=prompt, image_data=images)
    assert_matches_hf(fewer, hf_processor(text=[prompt], images=images, images_kwargs=small, return_tensors="pt"),
                      hf_processor)
    assert len(fewer.input_ids) < len(first.input_ids)
    assert fewer.mm_inputs.items[0].hash != first.mm_inputs.items[0].hash


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
    from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=images)  # one placeholder per image
    for out in (processed, precomputed, from_ids):
        assert out.input_ids == ids
        assert [i.offsets for i in out.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]
    assert all(torch.equal(a.feature, b.feature) for a, b in zip(processed.mm_inputs.items, raw.mm_inputs.items))
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[counts[0]:])


def test_text_only_and_refusals(ckpt, make_processor):
    hf_processor = ckpt[0]
    proc = make_processor(limit_mm_per_request={"image": 1})
    assert proc.process(prompt="hello there").input_ids == hf_processor.tokenizer("hello there")["input_ids"]
    img = scene_image(7, (64, 64))
    with pytest.raises(ValueError, match="too many image items"):
        proc.process(prompt=chat(hf_processor, ["image", "image", "?"]), image_data=[img, img])
    with pytest.raises(ValueError, match="image placeholder"):
        proc.process(prompt=chat(hf_processor, ["image", "image", "?"]), image_data=[img])
    with pytest.raises(ValueError, match="does not accept video"):
        proc.process(prompt="x", video_data=[[img, img]])
    with pytest.raises(ValueError, match="multiples of the patch size"):
        proc.process(prompt=chat(hf_processor, ["image", "?"]), image_data=[
            {"format": "processor_output", "pixel_values": torch.zeros(1, 3, 20, 20), "image_sizes": [[20, 20]]}])


def test_deferred_images_match_eager(ckpt, make_processor):
    """The capped, patch-aligned size from the image's size, for images under and over the longest edge."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat(ckpt[0], ["image", "What is this?"])
    assert_deferred_matches_eager(make_processor, prompt, [(7, 9), (33, 17), (100, 31), (250, 400)],
                                  expect_eager=[(250, 400)])
