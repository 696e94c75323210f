"""Cosmos3EdgeProcessor against transformers' Cosmos3EdgeProcessor: input_ids (a video's frames in place of the
template's whole <|vision_start|><|video_pad|><|vision_end|>), placeholder runs, pixels, grids and M-RoPE
positions (HF's Cosmos3EdgeModel.get_rope_index), for several image sizes, two images and two videos, the
preprocessing-cache path and caller-supplied input_ids; --mm-process-config limits reach HF's processor."""

from __future__ import annotations

import types

import pytest
import torch

from tessera.multimodal.processors.base import ProcessorOutput
from tests.models.cosmos3_testing import tiny_cosmos3_edge_processor_and_config
from tests.models.mrope_vlm_testing import mm_types

from .processor_checks import assert_frame_runs_match_hf
from .conftest import chat_text, encode_mp4, encode_png, processor_factory, scene_frames, scene_image


@pytest.fixture(scope="module")
def hf_pair():
    return tiny_cosmos3_edge_processor_and_config()


@pytest.fixture
def make(hf_pair):
    with processor_factory(*hf_pair) as factory:
        yield factory


def hf_reference(hf_pair, prompt: str, images=(), clips=(), **images_kwargs):
    kwargs = {"text": [prompt], "return_tensors": "pt"}
    if images:
        kwargs["images"] = list(images)
        if images_kwargs:
            kwargs["images_kwargs"] = images_kwargs
    if clips:
        kwargs["videos"] = [c.frames for c in clips]
        kwargs["videos_kwargs"] = {"do_sample_frames": False, "return_metadata": True, "video_metadata": [
            {"fps": c.fps, "total_num_frames": c.total_num_frames, "frames_indices": c.sampled_indices}
            for c in clips]}
    return hf_pair[0](**kwargs)


def hf_rope_index(config, ref) -> tuple[torch.Tensor, int]:
    """transformers' Cosmos3EdgeModel.get_rope_index on the HF processor's output (it reads only the config; the
    token types are its pads', which the processor returns only when asked)."""
    from transformers.models.cosmos3_edge.modeling_cosmos3_edge import Cosmos3EdgeModel

    fake = types.SimpleNamespace(config=config, get_vision_position_ids=lambda *a, **k:
                                 Cosmos3EdgeModel.get_vision_position_ids(None, *a, **k))
    types_ = mm_types(ref["input_ids"][0].tolist(), config.image_token_id, config.video_token_id)[None]
    pos, delta = Cosmos3EdgeModel.get_rope_index(fake, ref["input_ids"], types_,
                                                 image_grid_thw=ref.get("image_grid_thw"),
                                                 video_grid_thw=ref.get("video_grid_thw"))
    return pos[:, 0], int(delta.reshape(-1)[0])


def assert_matches_hf(out: ProcessorOutput, ref, config) -> None:
    assert_frame_runs_match_hf(out, ref, config, hf_rope_index)


@pytest.mark.parametrize("size", [(20, 20), (64, 64), (333, 251), (90, 700)])
def test_single_image_parity_across_sizes(hf_pair, make, size):
    img = scene_image(sum(size), size)
    prompt = chat_text(hf_pair[0], ["image", "What color is the circle?"])
    out = make().process(prompt=prompt, image_data=[encode_png(img)])
    assert_matches_hf(out, hf_reference(hf_pair, prompt, images=[img]), hf_pair[1])


def test_two_images_and_two_videos_then_the_cache(hf_pair, make):
    """An mp4 (its own fps) and a list of frames (no fps: HF's 24), each replacing its whole vision wrapper;
    then the same request from the preprocessing cache, expanded by us."""
    images = [scene_image(1, (300, 200)), scene_image(2, (90, 400))]
    mp4 = encode_mp4([f.resize((120, 90)) for f in scene_frames(3)], fps=10)
    frames = [f.resize((64, 96)) for f in scene_frames(4)][:5]
    prompt = chat_text(hf_pair[0], ["image", "video", "then", "image", "video", "Describe."])
    proc = make(mm_process_config={"video": {"num_frames": 4}}, cache_size_bytes=1 << 26)
    loaded = proc.load_mm_data_sync(image_data=images, video_data=[mp4, frames])
    ref = hf_reference(hf_pair, prompt, images=images, clips=tuple(loaded.videos))
    out = proc.process_and_combine_mm_data(prompt, None, loaded)
    assert_matches_hf(out, ref, hf_pair[1])
    text = hf_pair[0].tokenizer.decode(out.input_ids)
    assert "<|vision_start|><|vision_start|>" not in text and "<|vision_end|><|vision_end|>" not in text
    hits = proc.preprocess_cache_hits
    again = proc.process(prompt=prompt, image_data=images, video_data=[mp4, frames])
    assert proc.preprocess_cache_hits == hits + 4 and again.input_ids == out.input_ids
    assert torch.equal(again.mm_inputs.mrope_positions, out.mm_inputs.mrope_positions)


def test_caller_input_ids_and_a_bare_video_pad(hf_pair, make):
    """Unexpanded input_ids: the wrapped placeholder loses its wrapper, a bare <|video_pad|> is replaced alone."""
    from tessera.multimodal.media import VideoClip

    clip = VideoClip([f.resize((64, 64)) for f in scene_frames(7)][:4], fps=2.0, total_num_frames=4,
                     sampled_indices=[0, 1, 2, 3])
    proc = make()
    for prompt in (chat_text(hf_pair[0], ["video", "What happens?"]), "Watch <|video_pad|> and tell."):
        ref = hf_reference(hf_pair, prompt, clips=(clip,))
        assert_matches_hf(proc.process(input_ids=proc.tokenize(prompt), video_data=[clip]), ref, hf_pair[1])


def test_mm_process_config_limits_reach_hf(hf_pair, make):
    """max_pixels caps an image's patches as HF's longest_edge does."""
    img = scene_image(9, (300, 300))
    prompt = chat_text(hf_pair[0], ["image", "?"])
    out = make(mm_process_config={"image": {"max_pixels": 64 * 64}}).process(prompt=prompt, image_data=[img])
    ref = hf_reference(hf_pair, prompt, images=[img], size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64})
    assert_matches_hf(out, ref, hf_pair[1])
    assert ref["image_grid_thw"].tolist() == [[1, 4, 4]]
    full = make().process(prompt=prompt, image_data=[img])
    assert full.mm_inputs.items[0].num_tokens > out.mm_inputs.items[0].num_tokens
