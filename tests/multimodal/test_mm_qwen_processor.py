"""QwenVLProcessor against the HF Qwen2VLProcessor: ids, placeholder runs, pixels, grids;
the three input formats; and every refusal (limits, mixing, counts, modes)."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.messages.items import PAD_VALUE_BASE, Modality
from tessera.multimodal.media import MediaError, MediaLimits
from tessera.multimodal.processors.base import ProcessorOutput
from tessera.multimodal.processors.qwen_vl import QwenVLProcessor
from tests.multimodal.processor_registry import architecture_of, get_processor_class

from . import processor_checks
from .conftest import (
    chat_text,
    decode_all_frames,
    encode_mp4,
    encode_png,
    scene_frames,
    scene_image,
)

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"


def chat_prompt(skeleton, parts: list[str]) -> str:
    """The demo chat template over image/video/text parts (placeholders inserted by it)."""
    return chat_text(skeleton.processor, parts)


def hf_reference(skeleton, prompt, images=None, videos=None, images_kwargs=None, videos_kwargs=None):
    kwargs = {"text": [prompt], "return_tensors": "pt"}
    if images:
        kwargs.update(images=images, images_kwargs=images_kwargs or {})
    if videos:
        kwargs.update(videos=videos, videos_kwargs={"do_sample_frames": False, **(videos_kwargs or {})})
    return skeleton.processor(**kwargs)


def assert_matches_hf(out: ProcessorOutput, ref) -> None:
    for modality, item, _ in processor_checks.matching_grid_items(out, ref):
        assert len(item.offsets) == 1
        s, e = item.offsets[0]
        token = {Modality.IMAGE: 5, Modality.VIDEO: 6}[modality]
        assert set(out.input_ids[s:e]) == {token} and out.input_ids[s - 1] != token
        assert item.pad_value >= PAD_VALUE_BASE


def test_registry(skeleton):
    assert architecture_of(skeleton.config) == "Qwen2VLForConditionalGeneration"
    assert get_processor_class("Qwen2VLForConditionalGeneration") is QwenVLProcessor
    assert get_processor_class("Qwen2_5_VLForConditionalGeneration") is QwenVLProcessor
    with pytest.raises(ValueError, match="no multimodal processor for architecture 'LlamaForCausalLM'"):
        get_processor_class("LlamaForCausalLM")


SIZES = [(20, 20), (56, 56), (128, 512), (512, 128), (333, 251), (640, 480), (1000, 90), (57, 999)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(skeleton, make_processor, size):
    img = scene_image(sum(size), size)
    prompt = chat_prompt(skeleton, ["image", "What color is the circle?"])
    out = make_processor().process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_reference(skeleton, prompt, images=[img]))


def test_many_images_and_videos_with_limits(skeleton, make_processor):
    rng = random.Random(0)
    images = [scene_image(i, (rng.randint(30, 700), rng.randint(30, 700))) for i in range(4)]
    clip_a = [f.resize((200, 120)) for f in scene_frames(1)]
    clip_b = [f.resize((90, 300)) for f in scene_frames(2)]
    mp4 = encode_mp4(clip_b, fps=10)
    config = {"image": {"max_pixels": 28 * 28 * 24, "min_pixels": 28 * 28 * 6},
              "video": {"max_pixels": 28 * 28 * 4, "num_frames": 4}}
    proc = make_processor(mm_process_config=config)
    prompt = chat_prompt(skeleton, ["image", "and", "video", "image", "image", "then", "video", "image", "?"])
    out = proc.process(prompt=prompt, image_data=[encode_png(i) for i in images], video_data=[clip_a, mp4])
    # Reference: the same frames sampled independently (list videos are kept whole).
    decoded = decode_all_frames(mp4)
    idx = [round(x) for x in torch.linspace(0, len(decoded) - 1, 4).tolist()]
    ref = hf_reference(skeleton, prompt, images=images, videos=[clip_a, [decoded[i] for i in idx]],
                       images_kwargs={"size": {"longest_edge": 28 * 28 * 24, "shortest_edge": 28 * 28 * 6}},
                       videos_kwargs={"size": {"longest_edge": 28 * 28 * 4, "shortest_edge": 56 * 56}})
    assert_matches_hf(out, ref)
    assert [i.modality.value for i in out.mm_inputs.items] == ["image", "video", "image", "image", "video", "image"]
    for item in out.mm_inputs.items:  # limits took effect
        limit = 28 * 28 * (24 if item.modality is Modality.IMAGE else 4)
        grid = item.model_specific_data["image_grid_thw" if item.modality is Modality.IMAGE else "video_grid_thw"]
        assert int(grid[0, 1] * grid[0, 2]) * 14 * 14 <= limit
    # Default config differs: more tokens, different hashes for the same images.
    plain = make_processor().process(prompt=prompt, image_data=images, video_data=[clip_a, mp4])
    assert len(plain.input_ids) > len(out.input_ids)
    assert plain.mm_inputs.items[0].hash != out.mm_inputs.items[0].hash


def test_hashes_follow_content_not_source(skeleton, make_processor):
    img = scene_image(3)
    prompt = chat_prompt(skeleton, ["image", "image", "x"])
    proc = make_processor()
    a = proc.process(prompt=prompt, image_data=[img, encode_png(img)])
    assert a.mm_inputs.items[0].hash == a.mm_inputs.items[1].hash
    other = scene_image(4)
    b = proc.process(prompt=prompt, image_data=[img, other])
    assert b.mm_inputs.items[1].hash != a.mm_inputs.items[1].hash
    assert a.mm_inputs.pad_input_ids(a.input_ids) != b.mm_inputs.pad_input_ids(b.input_ids)


def test_three_formats_give_the_same_ids(skeleton, make_processor):
    images = [scene_image(5, (300, 200)), scene_image(6, (90, 400))]
    video = [f.resize((120, 90)) for f in scene_frames(3)]
    prompt = chat_prompt(skeleton, ["image", "video", "image", "Describe."])
    proc = make_processor()
    raw = proc.process(prompt=prompt, image_data=images, video_data=[video])
    ref = hf_reference(skeleton, prompt, images=images, videos=[video])
    ids = ref["input_ids"][0].tolist()
    as_dict = dict(ref, format="processor_output")
    processed = proc.process(input_ids=ids, image_data=[as_dict], video_data=[as_dict])
    n_img = int((ref["image_grid_thw"].prod(-1) // 4).sum())
    n_vid = int((ref["video_grid_thw"].prod(-1) // 4).sum())
    emb_img, emb_vid = torch.randn(n_img, 256), torch.randn(n_vid, 256)
    pre_img = dict(ref, format="precomputed_embedding", feature=emb_img)  # the seed's form: all HF keys + feature
    pre_vid = {"format": "precomputed_embedding", "feature": list(emb_vid.split([n_vid])),
               "video_grid_thw": ref["video_grid_thw"]}
    precomputed = proc.process(input_ids=ids, image_data=[pre_img], video_data=[pre_vid])
    unexpanded = proc.process(prompt=prompt, image_data=[pre_img], video_data=[pre_vid])
    raw_from_ids = proc.process(input_ids=proc.tokenize(prompt), image_data=images, video_data=[video])
    for out in (processed, precomputed, unexpanded, raw_from_ids):
        assert out.input_ids == raw.input_ids == ids
        assert [i.offsets for i in out.mm_inputs.items] == [i.offsets for i in raw.mm_inputs.items]
        assert torch.equal(out.mm_inputs.mrope_positions, raw.mm_inputs.mrope_positions)
    assert torch.equal(torch.cat([i.feature for i in processed.mm_inputs.items if i.modality is Modality.IMAGE]),
                       ref["pixel_values"])
    pre_items = precomputed.mm_inputs.items
    assert all(i.feature is None and i.precomputed_embedding is not None for i in pre_items)
    # A caller's tensors are copied (one image of our own processor output is not): changing them afterwards
    # changes nothing that was already processed.
    one = dict(hf_reference(skeleton, chat_prompt(skeleton, ["image", "Hi."]), images=images[:1]),
               format="processor_output")
    item = proc.process(input_ids=one["input_ids"][0].tolist(), image_data=[one]).mm_inputs.items[0]
    kept = item.feature.clone()
    one["pixel_values"].add_(1.0)
    assert torch.equal(item.feature, kept)
    assert torch.equal(torch.cat([pre_items[0].precomputed_embedding, pre_items[2].precomputed_embedding]), emb_img)


def test_text_only_request(skeleton, make_processor):
    proc = make_processor()
    assert proc.has_placeholders(chat_prompt(skeleton, ["image"])) and not proc.has_placeholders("hello there")
    out = proc.process(prompt="hello there")
    assert out.input_ids == skeleton.processor.tokenizer("hello there")["input_ids"]
    assert out.mm_inputs.items == [] and out.mm_inputs.mrope_position_delta == 0


# ---------------------------------------------------------------- refusals


def test_refusals(skeleton, make_processor):
    img = scene_image(7, (64, 64))
    one, two = chat_prompt(skeleton, ["image", "?"]), chat_prompt(skeleton, ["image", "image", "?"])
    proc = make_processor(limit_mm_per_request={"image": 1, "video": 0})
    with pytest.raises(ValueError, match="too many image items: 2 given, at most 1"):
        proc.process(prompt=two, image_data=[img, img])
    with pytest.raises(ValueError, match="too many video items: 1 given, at most 0"):
        proc.process(prompt=chat_prompt(skeleton, ["video"]), video_data=[[img, img]])
    ref = hf_reference(skeleton, two, images=[img, img])
    with pytest.raises(ValueError, match="too many image items: 2 given"):  # counted after splitting the dict
        proc.process(input_ids=ref["input_ids"][0].tolist(), image_data=[dict(ref, format="processor_output")])
    proc = make_processor()
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*but 2 image item"):
        proc.process(prompt=one, image_data=[img, img])
    with pytest.raises(ValueError, match="no media placeholders"):
        proc.process(prompt="What is this?", image_data=[img])
    with pytest.raises(ValueError, match=r"prompt has 1 image placeholder\(s\).*but 0 image item"):
        proc.process(prompt=one)
    with pytest.raises(ValueError, match="input_ids have 1 image placeholder tokens but no image items"):
        proc.process(input_ids=[1, 5, 2])
    with pytest.raises(ValueError, match="input_ids contains no media placeholders"):
        proc.process(input_ids=[1, 2, 3], image_data=[img])
    with pytest.raises(ValueError, match="input_ids have 2 image placeholder tokens; expected 1"):
        proc.process(input_ids=[5, 1, 5], image_data=[img])
    with pytest.raises(ValueError, match="one input format per request; got a mix of processor_output, raw"):
        proc.process(input_ids=ref["input_ids"][0].tolist(), image_data=[img, dict(ref, format="processor_output")])
    with pytest.raises(ValueError, match="mix of precomputed_embedding, raw"):
        proc.process(prompt=chat_prompt(skeleton, ["image", "video"]), image_data=[img],
                     video_data=[{"format": "precomputed_embedding", "feature": torch.zeros(1, 8)}])
    with pytest.raises(ValueError, match="format='processor_output' or 'precomputed_embedding'"):
        proc.process(prompt=one, image_data=[{"format": "pixels"}])
    with pytest.raises(ValueError, match="needs 'image_grid_thw'"):
        proc.process(prompt=one, image_data=[{"format": "precomputed_embedding", "feature": torch.zeros(4, 8)}])
    with pytest.raises(ValueError, match=r"feature has shape \(3, 8\); image_grid_thw needs \[16, hidden\]"):
        proc.process(prompt=one, image_data=[{"format": "precomputed_embedding", "feature": torch.zeros(3, 8),
                                              "image_grid_thw": torch.tensor([[1, 8, 8]])}])
    with pytest.raises(ValueError, match="does not accept audio"):
        proc.process(prompt="x", audio_data=[b"RIFF"])
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        proc.process(prompt=one, input_ids=[1], image_data=[img])
    with pytest.raises(ValueError, match="language-model-only mode; image inputs are refused"):
        make_processor(language_model_only=True).process(prompt=one, image_data=[img])


@pytest.mark.parametrize(("config", "message"), [
    ({"picture": {}}, "unknown modality 'picture'"),
    ({"image": {"max_pixels": -1}}, r"\['max_pixels'\] must be positive"),
    ({"image": {"max_pixels": 100, "min_pixels": 200}}, "min_pixels exceeds max_pixels"),
    ({"video": 3}, "must be a dict"),
])
def test_bad_process_config(make_processor, config, message):
    with pytest.raises(ValueError, match=message):
        make_processor(mm_process_config=config)


def test_bad_media_surfaces_as_media_error(skeleton, make_processor, tmp_path):
    one = chat_prompt(skeleton, ["image", "?"])
    proc = make_processor(limits=MediaLimits(allowed_local_media_path=str(tmp_path)))
    with pytest.raises(MediaError, match="not a recognised image"):
        proc.process(prompt=one, image_data=[b"garbage bytes"])
    with pytest.raises(MediaError, match="outside the allowed directory"):
        proc.process(prompt=one, image_data=["/etc/hostname"])
    with pytest.raises(MediaError, match="truncated"):
        proc.process(prompt=chat_prompt(skeleton, ["video"]),
                     video_data=[encode_mp4(scene_frames(4))[:-300]])


def test_preprocessed_tensors_the_model_cannot_take_are_refused(skeleton, make_processor):
    """Checked in the frontend: a shape the tower or the language model rejects would
    otherwise fail inside the scheduler process, taking the whole batch with it."""
    one = chat_prompt(skeleton, ["image", "?"])
    proc = make_processor()
    grid = torch.tensor([[1, 4, 4]])
    hidden = skeleton.config.get_text_config().hidden_size
    with pytest.raises(ValueError, match=rf"language model takes floating-point rows of {hidden} values"):
        proc.process(prompt=one, image_data=[{"format": "precomputed_embedding", "feature": torch.zeros(4, hidden + 1),
                                              "image_grid_thw": grid}])
    with pytest.raises(ValueError, match="language model takes floating-point rows"):
        proc.process(prompt=one, image_data=[{"format": "precomputed_embedding", "image_grid_thw": grid,
                                              "feature": torch.zeros(4, hidden, dtype=torch.long)}])
    with pytest.raises(ValueError, match=r"vision tower takes floating-point rows of 1176 values"):
        proc.process(prompt=one, image_data=[{"format": "processor_output", "pixel_values": torch.zeros(16, 1000),
                                              "image_grid_thw": grid}])
    with pytest.raises(ValueError, match="h and w must be multiples of merge_size = 2"):
        proc.process(prompt=one, image_data=[{"format": "processor_output", "pixel_values": torch.zeros(4, 1176),
                                              "image_grid_thw": torch.tensor([[1, 1, 4]])}])
    ok = proc.process(prompt=one, image_data=[{"format": "processor_output", "pixel_values": torch.zeros(16, 1176),
                                               "image_grid_thw": grid}])
    assert ok.mm_inputs.items[0].num_tokens == 4


def test_deferred_images_match_eager_across_sizes(skeleton, make_processor):
    """smart_resize's grid from the size alone, for tiny, odd, extreme and large images, with the demo's
    224x224-ish default (large images fall back to eager: their pixels outweigh the features) and with
    max_pixels raised (large images stay deferred)."""
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat_prompt(skeleton, ["image", "Describe."])
    small = [(28, 28), (29, 57), (300, 200), (1000, 37), (37, 1000)]
    assert_deferred_matches_eager(make_processor, prompt, small + [(1024, 768)], expect_eager=[(1024, 768)])
    assert_deferred_matches_eager(make_processor, prompt, [(641, 479), (1536, 1024), (900, 1300)],
                                  process_config={"image": {"max_pixels": 1572864, "min_pixels": 3136}})


def test_deferred_and_eager_images_in_one_prompt(skeleton, make_processor):
    """A small image (deferred) and a large one (eager fallback) in one prompt: HF's ids and positions, the
    eager item through the HF processor alone."""
    from tests.multimodal.deferred_testing import noise_image

    prompt = chat_prompt(skeleton, ["image", "and", "image", "Compare."])
    images = [noise_image(90, 60, seed=1), noise_image(1024, 768, seed=2)]
    mixed = make_processor(defer_images=True).process(prompt=prompt, image_data=images)
    eager = make_processor().process(prompt=prompt, image_data=images)
    assert [it.deferred is not None for it in mixed.mm_inputs.items] == [True, False]
    assert mixed.input_ids == eager.input_ids
    assert torch.equal(mixed.mm_inputs.mrope_positions, eager.mm_inputs.mrope_positions)
    assert [it.hash for it in mixed.mm_inputs.items] == [it.hash for it in eager.mm_inputs.items]
    assert torch.equal(mixed.mm_inputs.items[1].feature, eager.mm_inputs.items[1].feature)


def test_deferral_floor_keeps_small_features_eager(skeleton, make_processor):
    """With the server's floor (DEFER_MIN_FEATURE_BYTES), the demo's ~224x224 features (1.2 MB) stay eager,
    while the same image at max_pixels 1572864 (features over the floor, pixels under them) is deferred."""
    from tessera.multimodal.deferred import DEFER_MIN_FEATURE_BYTES
    from tests.multimodal.deferred_testing import noise_image

    prompt = chat_prompt(skeleton, ["image", "Describe."])
    image = noise_image(644, 476, seed=4)
    floor = {"defer_images": True, "defer_min_feature_bytes": DEFER_MIN_FEATURE_BYTES}
    (small,) = make_processor(**floor).process(prompt=prompt, image_data=[image]).mm_inputs.items
    assert small.deferred is None and 0 < small.transport_bytes < DEFER_MIN_FEATURE_BYTES
    (unfloored,) = make_processor(defer_images=True).process(prompt=prompt, image_data=[image]).mm_inputs.items
    assert unfloored.deferred is not None  # without the floor, pixels < features is enough
    kept = make_processor(mm_process_config={"image": {"max_pixels": 1572864}}, **floor)
    (large,) = kept.process(prompt=prompt, image_data=[image]).mm_inputs.items
    assert large.deferred is not None and large.transport_bytes == 3 * 644 * 476 + sum(
        v.numel() * v.element_size() for v in large.model_specific_data.values())
