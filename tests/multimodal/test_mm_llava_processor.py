"""LlavaProcessor / LlavaNextProcessor against HF's LlavaProcessor / LlavaNextProcessor: input_ids, placeholder
runs, pixel values and image sizes; token counts for every aspect ratio; the three input formats, the
preprocessing-cache path (placeholders expanded by our counts) and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.messages.items import Modality
from tessera.multimodal.media import MediaLimits
from tessera.multimodal.processors.llava import LlavaNextProcessor, LlavaProcessor
from tests.multimodal.processor_registry import create_processor
from tests.models.llava_testing import SPECS, make_tiny_llava_checkpoint

from .conftest import encode_png, scene_image

# (width, height) for scene_image: wide, tall, square, extreme both ways, tiny, one tile
SIZES = [(70, 30), (30, 70), (50, 50), (200, 20), (21, 190), (5, 3), (28, 28), (333, 251)]


@dataclasses.dataclass
class Ckpt:
    path: Path
    config: Any
    hf: Any  # the HF processor


def _skeleton(tmp_path_factory, name: str) -> Ckpt:
    from transformers import AutoConfig, AutoProcessor

    path = make_tiny_llava_checkpoint(tmp_path_factory.mktemp(name), name, weights=False)
    return Ckpt(path, AutoConfig.from_pretrained(path), AutoProcessor.from_pretrained(path))


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Ckpt:
    return _skeleton(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def llava_full(tmp_path_factory) -> Ckpt:
    return _skeleton(tmp_path_factory, "mistral")  # "full" strategy: the CLS token is an image token too


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory) -> Ckpt:
    return _skeleton(tmp_path_factory, "next_llama")


@pytest.fixture
def make(request):
    made = []

    def make_processor(ckpt: Ckpt, hf_processor: Any = None, **kwargs: Any):
        kwargs.setdefault("limits", MediaLimits.offline())
        proc = create_processor(hf_processor or ckpt.hf, ckpt.config, **kwargs)
        made.append(proc)
        return proc

    yield make_processor
    for proc in made:
        proc.close()


def chat(ckpt: Ckpt, num_images: int, text: str = "What is in the image?") -> str:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    return ckpt.hf.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)


def assert_matches_hf(ckpt: Ckpt, out, ref, is_next: bool) -> None:
    image_id = ckpt.config.image_token_id
    assert out.input_ids == ref["input_ids"][0].tolist()
    items = out.mm_inputs.items
    runs = []
    start = None
    for i, t in enumerate(out.input_ids + [-1]):
        if t == image_id and start is None:
            start = i
        elif t != image_id and start is not None:
            runs.append((start, i))
            start = None
    # Adjacent images would merge into one run; the prompts here separate them with "\n".
    assert [it.offsets for it in items] == [[r] for r in runs]
    for i, item in enumerate(items):
        assert item.modality is Modality.IMAGE and item.num_tokens == runs[i][1] - runs[i][0]
        if not is_next:
            assert torch.equal(item.feature, ref["pixel_values"][i])
            continue
        assert torch.equal(item.model_specific_data["image_sizes"], ref["image_sizes"][i: i + 1])
        tiles = item.feature.shape[0]
        assert torch.equal(item.feature, ref["pixel_values"][i, :tiles])
        assert not ref["pixel_values"][i, tiles:].any(), "only HF's batch padding is dropped"


def test_registry_picks_the_family_processor(llava, llava_next, make):
    assert type(make(llava)) is LlavaProcessor
    assert type(make(llava_next)) is LlavaNextProcessor


@pytest.mark.parametrize("size", SIZES)
def test_llava_single_image_parity(llava, make, size):
    img = scene_image(sum(size), size)
    prompt = chat(llava, 1)
    out = make(llava).process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(llava, out, llava.hf(text=[prompt], images=[img], return_tensors="pt"), is_next=False)
    assert out.mm_inputs.items[0].num_tokens == 9  # 3x3 patches, CLS dropped


def test_llava_full_strategy_and_two_images(llava_full, make):
    images = [scene_image(1, (60, 40)), scene_image(2, (40, 90))]
    prompt = chat(llava_full, 2)
    out = make(llava_full).process(prompt=prompt, image_data=images)
    assert_matches_hf(llava_full, out, llava_full.hf(text=[prompt], images=images, return_tensors="pt"), False)
    assert [it.num_tokens for it in out.mm_inputs.items] == [17, 17]  # 4x4 patches + CLS


@pytest.mark.parametrize("size", SIZES)
def test_llava_next_single_image_parity(llava_next, make, size):
    img = scene_image(sum(size) + 1, size)
    prompt = chat(llava_next, 1)
    out = make(llava_next).process(prompt=prompt, image_data=[img])
    assert_matches_hf(llava_next, out, llava_next.hf(text=[prompt], images=[img], return_tensors="pt"), True)


def test_llava_next_images_of_different_tile_counts_in_one_prompt(llava_next, make):
    images = [scene_image(i, size) for i, size in enumerate([(200, 20), (50, 50), (5, 3)])]
    prompt = chat(llava_next, 3)
    out = make(llava_next).process(prompt=prompt, image_data=images)
    ref = llava_next.hf(text=[prompt], images=images, return_tensors="pt")
    assert_matches_hf(llava_next, out, ref, True)
    assert len({it.feature.shape[0] for it in out.mm_inputs.items}) > 1


def test_llava_next_token_counts_equal_hf_for_every_aspect_ratio(llava_next, make):
    proc = make(llava_next)
    side = SPECS["next_llama"].image_size
    sides = list(range(1, 120, 3)) + [27, 28, 29, 55, 56, 57, 83, 84, 85, 500, 1000]
    for h in sides:
        for w in sides:
            ref = llava_next.hf._get_number_of_features(h, w, side, side) - 1  # "default" drops the CLS token
            assert proc.geometry.num_image_tokens((h, w)) == ref, (h, w)


def test_cache_hits_and_input_ids_expand_like_hf(llava_next, make):
    """A repeated image skips the HF processor (our counts expand the placeholders); input_ids with one
    placeholder per image expand the same way."""
    images = [scene_image(7, (90, 31)), scene_image(8, (31, 90))]
    prompt = chat(llava_next, 2)
    proc = make(llava_next, cache_size_bytes=64 << 20)
    first = proc.process(prompt=prompt, image_data=images)
    again = proc.process(prompt=prompt, image_data=images[::-1])
    assert proc.preprocess_cache_hits == 2
    ref = llava_next.hf(text=[prompt], images=images[::-1], return_tensors="pt")
    assert_matches_hf(llava_next, again, ref, True)
    from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=images)
    assert from_ids.input_ids == first.input_ids
    assert [i.hash for i in from_ids.mm_inputs.items] == [i.hash for i in first.mm_inputs.items]


@pytest.mark.parametrize("name", ["llava", "llava_next"])
def test_three_formats_give_the_same_ids(name, request, make):
    ckpt = request.getfixturevalue(name)
    is_next = name == "llava_next"
    images = [scene_image(3, (120, 40)), scene_image(4, (40, 40))]
    prompt = chat(ckpt, 2)
    proc = make(ckpt)
    raw = proc.process(prompt=prompt, image_data=images)
    ref = ckpt.hf(text=[prompt], images=images, return_tensors="pt")
    processed = proc.process(input_ids=ref["input_ids"][0].tolist(),
                             image_data=[dict(ref, format="processor_output")])
    hidden = ckpt.config.text_config.hidden_size
    embeds = [torch.randn(it.num_tokens, hidden) for it in raw.mm_inputs.items]
    pre = {"format": "precomputed_embedding", "feature": embeds}
    if is_next:
        pre["image_sizes"] = ref["image_sizes"]
    precomputed = proc.process(prompt=prompt, image_data=[pre])
    for out in (processed, precomputed):
        assert out.input_ids == raw.input_ids
        assert [i.offsets for i in out.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]
    for a, b in zip(processed.mm_inputs.items, raw.mm_inputs.items):
        assert torch.equal(a.feature, b.feature)
    assert all(torch.equal(i.precomputed_embedding, e) for i, e in zip(precomputed.mm_inputs.items, embeds))


def test_text_only_request(llava, make):
    out = make(llava).process(prompt="hello there")
    assert out.input_ids == llava.hf.tokenizer("hello there")["input_ids"] and out.mm_inputs.items == []


def test_refusals(llava, llava_next, make):
    from transformers import LlavaNextProcessor as HFNext
    from transformers import LlavaProcessor as HFLlava

    hf = llava.hf
    wrong_patch = HFLlava(image_processor=hf.image_processor, tokenizer=hf.tokenizer, patch_size=7,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)
    with pytest.raises(ValueError, match="patch_size"):
        make(llava, wrong_patch)
    no_cls = HFLlava(image_processor=hf.image_processor, tokenizer=hf.tokenizer, patch_size=14,
                     vision_feature_select_strategy="default", num_additional_image_tokens=0)
    with pytest.raises(ValueError, match="num_additional_image_tokens"):
        make(llava, no_cls)
    nhf = llava_next.hf
    other_grid = nhf.image_processor.__class__(**{**nhf.image_processor.to_dict(), "image_grid_pinpoints": [[28, 56]]})
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        make(llava_next, HFNext(image_processor=other_grid, tokenizer=nhf.tokenizer, patch_size=7,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1))
    with pytest.raises(ValueError, match="max_pixels"):
        make(llava, mm_process_config={"image": {"max_pixels": 1000}})
    proc = make(llava)
    with pytest.raises(ValueError, match="pixel_values has shape"):
        proc.process(prompt=chat(llava, 1), image_data=[{"format": "processor_output",
                                                         "pixel_values": torch.zeros(1, 3, 28, 28)}])
    with pytest.raises(ValueError, match="each image has 9 tokens"):
        proc.process(prompt=chat(llava, 1), image_data=[{"format": "precomputed_embedding",
                                                         "feature": torch.zeros(8, 64)}])
    nproc = make(llava_next)
    with pytest.raises(ValueError, match="image_sizes"):
        nproc.process(prompt=chat(llava_next, 1), image_data=[{"format": "processor_output",
                                                               "pixel_values": torch.zeros(1, 5, 3, 28, 28)}])
    with pytest.raises(ValueError, match="expected floating-point"):
        nproc.process(prompt=chat(llava_next, 1), image_data=[{
            "format": "processor_output", "pixel_values": torch.zeros(1, 2, 3, 28, 28),
            "image_sizes": torch.tensor([[50, 50]])}])  # a 50x50 image has 5 tiles


def test_deferred_images_match_eager(llava, llava_next, make):
    """LLaVA: one crop whatever the size (large images take the fallback: one crop is smaller than their
    pixels); NeXT: the anyres tile count and token count from the size."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    assert_deferred_matches_eager(lambda **kw: make(llava, **kw), chat(llava, 1), [(20, 30), (50, 40), (300, 200)],
                                  expect_eager=[(300, 200)])
    assert_deferred_matches_eager(lambda **kw: make(llava_next, **kw), chat(llava_next, 1),
                                  [(20, 30), (90, 20), (64, 96), (200, 150)], expect_eager=[(200, 150)])
