"""Glm4vProcessor against transformers' Glm4vProcessor: input_ids (a video as <|image|> frames each followed by its
whole-second timestamp, inside <|begin_of_video|> .. <|end_of_video|>), placeholder runs, pixels, grids and M-RoPE
positions (HF's get_rope_index); the preprocessing-cache path and caller-supplied input_ids expand as HF does;
--mm-process-config limits reach HF's processors; deferred images plan HF's grids."""

from __future__ import annotations

import pytest
import torch

from tessera.messages.items import Modality
from tessera.multimodal.media import VideoClip
from tessera.multimodal.processors.base import ProcessorOutput
from tests.models.glm4v_testing import tiny_glm4v_processor_and_config

from . import processor_checks
from .conftest import chat_text, encode_mp4, encode_png, processor_factory, scene_frames, scene_image


@pytest.fixture(scope="module")
def hf_pair():
    return tiny_glm4v_processor_and_config()


@pytest.fixture
def make(hf_pair):
    with processor_factory(*hf_pair) as factory:
        yield factory


def hf_reference(hf_pair, prompt: str, images=(), clips: tuple[VideoClip, ...] = (), **kwargs):
    call = {"text": [prompt], "return_tensors": "pt", **kwargs}
    if images:
        call["images"] = list(images)
    if clips:
        call["videos"] = [c.frames for c in clips]
        call.setdefault("videos_kwargs", {}).update({"do_sample_frames": False, "video_metadata": [
            {"fps": c.fps, "total_num_frames": c.total_num_frames, "frames_indices": c.sampled_indices}
            for c in clips]})
    return hf_pair[0](**call)


def assert_matches_hf(out: ProcessorOutput, ref, config) -> None:
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel

    for modality, item, (t, h, w) in processor_checks.matching_grid_items(out, ref):
        # An image is one run; a video one run per frame; every run is <|image|> tokens in their brackets, and HF's
        # mm_token_type_ids call them this modality's.
        assert len(item.offsets) == (1 if modality is Modality.IMAGE else t)
        for s, e in item.offsets:
            assert set(out.input_ids[s:e]) == {config.image_token_id}
            assert (out.input_ids[s - 1], out.input_ids[e]) == (config.image_start_token_id, config.image_end_token_id)
            assert set(ref["mm_token_type_ids"][0, s:e].tolist()) == {1 if modality is Modality.IMAGE else 2}
    positions, delta = processor_checks.hf_rope_index(Glm4vModel, config, ref)
    assert torch.equal(out.mm_inputs.mrope_positions, positions) and out.mm_inputs.mrope_position_delta == delta


SIZES = [(20, 20), (64, 64), (140, 40), (50, 190), (333, 251)]


@pytest.mark.parametrize("size", SIZES)
def test_single_image_parity_across_sizes(hf_pair, make, size):
    img = scene_image(sum(size), size)
    prompt = chat_text(hf_pair[0], ["image", "What color is the circle?"])
    out = make().process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_reference(hf_pair, prompt, images=[img]), hf_pair[1])


def test_two_images_then_cache_hit_and_input_ids(hf_pair, make):
    """Two images of other shapes, then the same request from the preprocessing cache (our own expansion) and
    from unexpanded input_ids: HF's ids, items and positions each time."""
    images = [scene_image(1, (130, 40)), scene_image(2, (50, 90))]
    prompt = chat_text(hf_pair[0], ["image", "and", "image", "Compare."])
    proc = make(cache_size_bytes=1 << 26)
    ref = hf_reference(hf_pair, prompt, images=images)
    out = proc.process(prompt=prompt, image_data=images)
    assert_matches_hf(out, ref, hf_pair[1])
    again = proc.process(prompt=prompt, image_data=images)
    assert proc.preprocess_cache_hits == 2
    from_ids = make().process(input_ids=proc.tokenize(prompt), image_data=images)
    for other in (again, from_ids):
        assert_matches_hf(other, ref, hf_pair[1])


def test_videos_with_timestamps(hf_pair, make):
    """An mp4 (its own fps, frames sampled by our loader; its frame times pass 1 s) and a list of frames (no fps:
    HF times them at 24 fps, odd count: the last frame repeats), each in its own prompt (transformers' model
    refuses an image and a video together, its processor does not); then from the cache and from input_ids."""
    mp4 = encode_mp4([f.resize((120, 90)) for f in scene_frames(3)], fps=4)
    frames = [f.resize((64, 96)) for f in scene_frames(4)][:5]
    prompt = chat_text(hf_pair[0], ["video", "then", "video", "Describe."])
    proc = make(mm_process_config={"video": {"num_frames": 6}}, cache_size_bytes=1 << 26)
    loaded = proc.load_mm_data_sync(video_data=[mp4, frames])
    clips = tuple(loaded.videos)
    assert clips[0].fps == 4 and clips[1].fps is None
    ref = hf_reference(hf_pair, prompt, clips=clips)
    out = proc.process_and_combine_mm_data(prompt, None, loaded)
    assert_matches_hf(out, ref, hf_pair[1])
    text = hf_pair[0].tokenizer.decode(out.input_ids)
    stamps = [int(i / 4) for i in clips[0].sampled_indices[::2]]
    assert stamps[-1] >= 1 and "".join(f"<|end_of_image|>{s}" for s in stamps) in text.replace(
        "<|begin_of_image|>", "").replace("<|image|>", "")
    again = proc.process(prompt=prompt, video_data=[mp4, frames])
    from_ids = make(mm_process_config={"video": {"num_frames": 6}}).process(input_ids=proc.tokenize(prompt),
                                                                            video_data=[mp4, frames])
    assert proc.preprocess_cache_hits == 2
    for other in (again, from_ids):
        assert_matches_hf(other, ref, hf_pair[1])


def test_image_and_video_in_one_prompt_positions(hf_pair, make):
    """HF's processor takes both (its model does not): runs are told apart by the video brackets, and the ids,
    pixels and positions are HF's."""
    image = scene_image(6, (160, 96))
    clip = VideoClip([f.resize((64, 64)) for f in scene_frames(7)][:4], fps=2.0, total_num_frames=4,
                     sampled_indices=[0, 1, 2, 3])
    prompt = chat_text(hf_pair[0], ["video", "image", "What happens?"])
    out = make().process(prompt=prompt, image_data=[image], video_data=[clip])
    assert [i.modality for i in out.mm_inputs.items] == [Modality.VIDEO, Modality.IMAGE]
    assert_matches_hf(out, hf_reference(hf_pair, prompt, images=[image], clips=(clip,)), hf_pair[1])


def test_process_config_limits_reach_hf(hf_pair, make):
    """--mm-process-config max_pixels / min_pixels become the HF processors' size: fewer tokens, HF's output."""
    image = scene_image(8, (333, 251))
    clip = VideoClip([f.resize((120, 90)) for f in scene_frames(9)][:4], fps=2.0, total_num_frames=4,
                     sampled_indices=[0, 1, 2, 3])
    config = {"image": {"max_pixels": 28 * 28 * 6, "min_pixels": 28 * 28 * 2},
              "video": {"max_pixels": 28 * 28 * 4, "min_pixels": 28 * 28}}
    for parts, kw in ((["image", "?"], {"image_data": [image]}), (["video", "?"], {"video_data": [clip]})):
        prompt = chat_text(hf_pair[0], parts)
        out = make(mm_process_config=config).process(prompt=prompt, **kw)
        ref = hf_reference(hf_pair, prompt, images=kw.get("image_data", ()), clips=tuple(kw.get("video_data", ())),
                           images_kwargs={"size": {"longest_edge": 28 * 28 * 6, "shortest_edge": 28 * 28 * 2}},
                           videos_kwargs={"size": {"longest_edge": 28 * 28 * 4, "shortest_edge": 28 * 28}})
        assert_matches_hf(out, ref, hf_pair[1])
        assert len(out.input_ids) < len(make().process(prompt=prompt, **kw).input_ids)


def test_bare_video_placeholder_refused(hf_pair, make):
    """A `<|video|>` outside <|begin_of_video|> .. <|end_of_video|> would be read as images by transformers: refused
    by name."""
    clip = VideoClip([f.resize((64, 64)) for f in scene_frames(5)][:2], fps=2.0, total_num_frames=2,
                     sampled_indices=[0, 1])
    with pytest.raises(ValueError, match="<|begin_of_video|>"):
        make().process(prompt="look <|video|> here", video_data=[clip])


def test_deferred_images_match_eager(hf_pair, make):
    from tests.multimodal.deferred_testing import assert_deferred_matches_eager

    prompt = chat_text(hf_pair[0], ["image", "Describe."])
    assert_deferred_matches_eager(make, prompt, [(32, 32), (33, 95), (300, 200)], expect_eager=[(300, 200)])
