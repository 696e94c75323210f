"""MllamaProcessor against transformers' MllamaProcessor: ids (BOS put after leading `<|image|>` tokens, the
image tokens kept), tiles padded to max_image_tiles, aspect-ratio ids and masks, and each image's token span
against HF's cross_attention_mask; the preprocessing cache; the three input formats; refusals."""

from __future__ import annotations

import pytest
import torch

from tessera.multimodal.processors.mllama import CROSS_SPAN, RATIO_ID, RATIO_MASK, MllamaProcessor
from tests.models.mllama_testing import make_tiny_mllama_checkpoint

from .conftest import chat_text, scene_image
from .processor_checks import check_formats_agree, check_single_image, checkpoint_fixtures

ckpt, make_processor = checkpoint_fixtures(make_tiny_mllama_checkpoint, "mllama_proc")


def assert_matches_hf(out, ref) -> None:
    """Ids, pixels and ratios are HF's; the spans rebuild HF's cross_attention_mask exactly (prompt rows)."""
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    assert all(it.offsets == [] for it in items)  # images own no tokens: the decoder cross-attends to them
    assert torch.equal(torch.stack([it.feature for it in items]), ref["pixel_values"][0].float())
    assert torch.equal(torch.stack([it.model_specific_data[RATIO_ID] for it in items]), ref["aspect_ratio_ids"][0])
    masks = torch.stack([it.model_specific_data[RATIO_MASK] for it in items])
    assert torch.equal(masks, ref["aspect_ratio_mask"][0])
    dense = torch.zeros_like(ref["cross_attention_mask"][0])
    for i, it in enumerate(items):
        lo, hi = it.model_specific_data[CROSS_SPAN].tolist()
        dense[lo:None if hi < 0 else hi, i, :int(masks[i].sum())] = 1
    assert torch.equal(dense, ref["cross_attention_mask"][0])


def test_registry(ckpt, make_processor):
    assert isinstance(make_processor(), MllamaProcessor)


# (width, height): one tile, wide, tall, square (2 x 2), tiny and large.
SIZES = [(28, 28), (70, 30), (28, 84), (60, 56), (10, 12), (170, 130)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(ckpt, make_processor, size):
    check_single_image(ckpt[0], make_processor, size, assert_matches_hf)


@pytest.mark.parametrize("parts", [["image", "Compare with", "image", "now."], ["image", "image", "Both?"],
                                   ["Look:", "image", "and", "image"]])
def test_two_images_spans_and_cache(ckpt, make_processor, parts):
    """Text between the images attends to the first only, back-to-back images share the rest; the same request
    again takes both images from the preprocessing cache and gives the same output."""
    hf_processor, _ = ckpt
    images = [scene_image(1, (100, 45)), scene_image(2, (30, 80))]
    prompt = chat_text(hf_processor, parts)
    proc = make_processor(cache_size_bytes=1 << 26)
    first = proc.process(prompt=prompt, image_data=images)
    assert_matches_hf(first, hf_processor(text=[prompt], images=images, return_tensors="pt"))
    again = proc.process(prompt=prompt, image_data=images)
    assert proc.preprocess_cache_hits == 2 and again.input_ids == first.input_ids
    assert [i.hash for i in again.mm_inputs.items] == [i.hash for i in first.mm_inputs.items]
    assert_matches_hf(again, hf_processor(text=[prompt], images=images, return_tensors="pt"))


def test_three_formats_give_the_same_ids(ckpt, make_processor):
    hf_processor, config = ckpt
    images = [scene_image(5, (75, 30)), scene_image(6, (28, 28))]
    prompt = chat_text(hf_processor, ["image", "image", "Describe."])
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images)
    fields = {"aspect_ratio_ids": torch.stack([it.model_specific_data[RATIO_ID] for it in raw.mm_inputs.items]),
              "aspect_ratio_mask": torch.stack([it.model_specific_data[RATIO_MASK] for it in raw.mm_inputs.items])}
    processed = proc.process(input_ids=raw.input_ids, image_data=[
        {"format": "processor_output", "pixel_values": torch.stack([it.feature for it in raw.mm_inputs.items]),
         **fields}])
    rows = 4 * ((config.vision_config.image_size // config.vision_config.patch_size) ** 2 + 1)
    embeds = [torch.randn(rows, config.text_config.hidden_size) for _ in images]
    precomputed = proc.process(prompt=prompt, image_data=[{"format": "precomputed_embedding", "feature": embeds,
                                                           **fields}])
    check_formats_agree(proc, prompt, images, raw, [processed, precomputed])
    for out in (processed, precomputed):
        assert [it.model_specific_data[CROSS_SPAN].tolist() for it in out.mm_inputs.items] == \
            [it.model_specific_data[CROSS_SPAN].tolist() for it in raw.mm_inputs.items]
    assert torch.equal(precomputed.mm_inputs.items[1].precomputed_embedding, embeds[1])


def test_text_only_and_refusals(ckpt, make_processor):
    """Text alone gets HF's ids (BOS first); too many images, fewer images than `<|image|>` tokens, pixels of
    the wrong shape and a max_image_tiles the tower was not built for are refused by name."""
    hf_processor, _ = ckpt
    proc = make_processor(limit_mm_per_request={"image": 1})
    assert proc.process(prompt="hello there").input_ids == hf_processor(text=["hello there"])["input_ids"][0]
    img = scene_image(7, (64, 64))
    with pytest.raises(ValueError, match="too many image items"):
        proc.process(prompt=chat_text(hf_processor, ["image", "image", "?"]), image_data=[img, img])
    with pytest.raises(ValueError, match="image placeholder"):
        proc.process(prompt=chat_text(hf_processor, ["image", "image", "?"]), image_data=[img])
    with pytest.raises(ValueError, match="pixel_values has shape"):
        proc.process(prompt=chat_text(hf_processor, ["image", "?"]), image_data=[
            {"format": "processor_output", "pixel_values": torch.zeros(1, 2, 3, 28, 28),
             "aspect_ratio_ids": [1], "aspect_ratio_mask": [[1, 0, 0, 0]]}])
    with pytest.raises(ValueError, match="max_image_tiles"):
        make_processor(mm_process_config={"image": {"max_image_tiles": 2}})
